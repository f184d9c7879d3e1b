"""SQuAD pretraining: data, MLM masking, loss going down, HuggingFace checkpoints (bad command lines:
test_bad_inputs.py).

Everything is made here: a word-level tokenizer trained on the test's own text (saved as a HuggingFace
tokenizer folder), a tiny SQuAD v2.0 file and tiny models (train_data.py, shared with test_capture.py)."""
import json
import time

import pytest
import torch
import transformers as hf

from syntorch.checkpoints import load_checkpoint
from syntorch.cli import main
from syntorch.errors import UserError
from syntorch.parallel.launch import RankFailed, init_distributed, spawn
from syntorch.options import Parser
from syntorch.train import squad as D
from syntorch.train.loop import train_rank
from syntorch.train.arguments import add_arguments, options_from_args
from train_data import WORDS, make_model, make_squad, make_tokenizer

@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    return {"root": root, "data": make_squad(root / "squad.json"), "tokenizer": make_tokenizer(root / "tok"),
            "gpt2": make_model(root / "gpt2", "gpt2"), "bert": make_model(root / "bert", "bert-base-uncased")}


def train_args(ws, family, save_dir, *extra):
    return ["train", family, "--data", str(ws["data"]), "--model-name", str(ws[family]), "--tokenizer",
            str(ws["tokenizer"]), "--device", "cpu", "--max-seq-length", "40", "--save-dir", str(save_dir), *extra]


# ---- data --------------------------------------------------------------------------------------------

def test_squad_v1_and_v2_give_question_context_pairs(tmp_path):
    v1 = {"version": "1.1", "data": [{"title": "x", "paragraphs": [
        {"context": "c one", "qas": [{"id": "1", "question": "q one", "answers": [{"text": "one", "answer_start": 2}]},
                                     {"id": "2", "question": "q two", "answers": []}]}]}]}
    (tmp_path / "v1.json").write_text(json.dumps(v1))
    assert D.load_squad(tmp_path / "v1.json") == [("q one", "c one"), ("q two", "c one")]
    assert len(D.load_squad(make_squad(tmp_path / "v2.json"))) == 6 * 2 * 4


@pytest.mark.parametrize("content, message", [
    (None, "not found"), ("{not json", "not valid JSON"), ('{"data": 3}', "not SQuAD"),
    ('{"data": [{"paragraphs": [{"context": 1, "qas": []}]}]}', "data[0].paragraphs[0]"),
    ('{"data": [{"paragraphs": [{"context": "c", "qas": [{"id": "1"}]}]}]}', "qas[0]"),
    ('{"data": []}', "no questions")])
def test_bad_squad_is_one_clear_error(tmp_path, content, message):
    path = tmp_path / "squad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        D.load_squad(path)


@pytest.mark.parametrize("text", ["the red cat sat on a mat ?", "Dog ran, to the PARK! unknownword"])
def test_tokenizer_folder_reads_like_transformers(workspace, tmp_path, text):
    theirs = hf.AutoTokenizer.from_pretrained(str(workspace["tokenizer"]))
    ours = D.LocalTokenizer(workspace["tokenizer"])
    assert ours.encode([text]) == [theirs(text, add_special_tokens=False)["input_ids"]] and len(ours) == len(theirs)
    assert ours.ids == {role: getattr(theirs, f"{role}_token_id") for role in D.ROLES}
    # a BERT folder with only vocab.txt (as older checkpoints ship it): uncased WordPiece
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "park", "##s", ",", "!", "?"]))
    bert = hf.BertTokenizerFast(str(tmp_path / "vocab.txt"))
    assert D.LocalTokenizer(tmp_path).encode([text]) == [bert(text, add_special_tokens=False)["input_ids"]]
    assert D.special_ids(D.LocalTokenizer(tmp_path), "bert") == {"cls": 2, "sep": 3, "mask": 4, "pad": 0, "eos": None}


def test_bert_input_is_cls_question_sep_context_sep(workspace):
    tok = D.LocalTokenizer(workspace["tokenizer"])
    ids = D.special_ids(tok, "bert")
    (tokens, types), = D.encode_masked([("red cat", "the dog ran to park")], tok, 8, ids)
    words = tok.tokens(tokens.tolist())
    assert words == ["[CLS]", "red", "cat", "[SEP]", "the", "dog", "ran", "[SEP]"]  # context cut to fit 8
    assert types.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_gpt2_input_is_question_then_context_then_eos(workspace):
    tok = D.LocalTokenizer(workspace["tokenizer"])
    (tokens,) = D.encode_causal([("red cat", "the dog")], tok, 16, tok.ids["eos"])
    assert tok.tokens(tokens.tolist()) == ["red", "cat", "the", "dog", "[EOS]"]


def test_mlm_masks_15_percent_as_80_10_10_and_never_special_tokens():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(10, 1000, (400, 500), generator=g)
    maskable = torch.ones_like(tokens, dtype=torch.bool)
    maskable[:, 0] = False  # [CLS]-like positions
    inputs, labels = D.mask_tokens(tokens, maskable, mask_id=3, vocab_size=1000, generator=g)
    chosen = labels != D.IGNORE
    assert not chosen[:, 0].any()
    assert torch.equal(labels[chosen], tokens[chosen]) and torch.equal(inputs[~chosen], tokens[~chosen])
    n = chosen.sum().item()
    assert abs(n / maskable.sum().item() - 0.15) < 0.005
    masked = (inputs[chosen] == 3).sum().item() / n
    kept = (inputs[chosen] == tokens[chosen]).sum().item() / n  # includes random draws of the same token (0.1%)
    assert abs(masked - 0.8) < 0.01 and abs(kept - 0.1) < 0.01 and abs(1 - masked - kept - 0.1) < 0.01


# ---- training, checkpoints ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(workspace):
    """One-rank runs of both families (DP over 2 ranks is in test_capture.py, other plans in test_train_plans.py)."""
    out = {}
    for family in ("gpt2", "bert"):
        save = workspace["root"] / f"ckpt_{family}"
        code = main(train_args(workspace, family, save, "--batch-size", "8", "--num-epochs", "3",
                               "--learning-rate", "1e-2", "--logging-steps", "2", "--eval-fraction", "0.2"))
        assert code == 0
        out[family] = save
    return out


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_loss_goes_down_on_tiny_data(trained, family):
    log = json.loads((trained[family] / "train_log.json").read_text())
    train = [h["loss"] for h in log if "loss" in h]
    evals = [h["eval_loss"] for h in log if "eval_loss" in h]
    assert len(train) >= 4 and len(evals) == 3  # an eval per epoch
    assert train[-1] < 0.8 * train[0], train
    assert evals[-1] < evals[0], evals


@pytest.mark.parametrize("family, hf_class", [("gpt2", hf.GPT2LMHeadModel), ("bert", hf.BertForMaskedLM)])
def test_best_and_last_checkpoints_load_with_transformers(trained, workspace, family, hf_class):
    for kind in ("best_model", "last_model"):
        folder = trained[family] / kind
        theirs = hf_class.from_pretrained(str(folder)).eval()
        _, ours = load_checkpoint(folder)
        tokens = torch.randint(0, 30, (2, 12))
        with torch.no_grad():
            assert torch.allclose(theirs(tokens).logits, ours(tokens), atol=1e-4)
        assert hf.AutoTokenizer.from_pretrained(str(folder)).mask_token == "[MASK]"  # saved beside the weights
    trained_weights = load_checkpoint(trained[family] / "last_model")[1].state_dict()
    initial = load_checkpoint(workspace[family])[1].state_dict()
    assert not torch.equal(trained_weights["tok_emb.weight"], initial["tok_emb.weight"])


# ---- DP -------------------------------------------------------------------------------------------------

def test_four_ranks_train_and_save(workspace, tmp_path, capfd):
    save = tmp_path / "ckpt"
    code = main(train_args(workspace, "gpt2", save, "--nproc", "4", "--batch-size", "2", "--max-steps", "2",
                           "--num-epochs", "1"))
    out = capfd.readouterr().out
    assert code == 0 and "2 steps on 4 rank(s)" in out, out
    assert load_checkpoint(save / "last_model")[1] is not None


def faulty_train_rank(opts):
    """Rank 1 fails after joining the group; rank 0 trains and would wait for it in the mesh's groups."""
    rank, _ = init_distributed("cpu")
    if rank == 1:
        raise RuntimeError("injected fault")
    train_rank(opts)


def test_a_crashing_worker_stops_every_worker_and_is_named(workspace, tmp_path):
    parser = Parser()
    add_arguments(parser)
    opts, _ = options_from_args(parser.parse_args(train_args(workspace, "gpt2", tmp_path / "ckpt")[1:]))
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"^rank 1 failed: RuntimeError: injected fault$"):
        spawn(faulty_train_rank, 2, (opts,))
    assert time.monotonic() - start < 60  # generous for a loaded 2-core machine; a hang would be 300 s
    assert not (tmp_path / "ckpt").exists()
