"""`syntorch infer` with an encoder (BERT): one pass, the top predictions at masked positions equal to
HuggingFace's fill-mask pipeline on a tiny checkpoint and WordPiece tokenizer made here; traced, tensor
parallel (real gloo ranks and symbolic) and exported like any run; generation options refused."""
import json

import pytest
import torch
import transformers as hf

from conftest import tiny_config
from syntorch.chakra.validator import validate_traces
from syntorch.cli import main
from syntorch.config import save_model_config
from syntorch.export import networkx_json

WORDS = "the cat sat on a mat and dog ran to it".split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s"]  # [MASK] is id 4
PROMPT = "the [MASK] sat on the [MASK]"  # [CLS] the [MASK] sat on the [MASK] [SEP]: masks at 2 and 6


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """(HF BertForMaskedLM, its checkpoint folder, a WordPiece tokenizer folder). The checkpoint folder has
    no vocab.txt, so only the tokenizer says which id is [MASK]."""
    root = tmp_path_factory.mktemp("bert")
    (root / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    hf.BertTokenizerFast(vocab_file=str(root / "vocab.txt")).save_pretrained(root / "tok")
    torch.manual_seed(0)
    model = hf.BertForMaskedLM(hf.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=64,
                                             max_position_embeddings=32)).eval()
    with torch.no_grad():  # peaked distributions: HF's N(0, 0.02) init makes every token nearly equally likely
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(root / "ckpt")
    return model, root / "ckpt", root / "tok"


def infer(out, *argv) -> dict:
    assert main(["infer", "--out", str(out), *argv]) == 0
    return json.loads((out / "run.json").read_text())


def masked_prompt_args(bert) -> list[str]:
    _, ckpt, tok = bert
    return ["--checkpoint", str(ckpt), "--tokenizer", str(tok), "--prompt", PROMPT]


def hf_top5(model, ids: list[int], positions: list[int]):
    with torch.no_grad():
        probs, top = model(torch.tensor([ids])).logits[0, positions].softmax(-1).topk(5)
    return top.tolist(), probs.tolist()


def assert_predictions_equal(got: list[dict], want: list[dict]):
    for g, w in zip(got, want, strict=True):
        assert g["position"] == w["position"] and g["ids"] == w["ids"], (g, w)
        assert g["probs"] == pytest.approx(w["probs"], abs=1e-5)


@pytest.mark.parametrize("text", [PROMPT, "the cat [MASK] on the mat"])
def test_masked_prompt_equals_hf_fill_mask(bert, tmp_path, capsys, text):
    model, ckpt, tok = bert
    record = infer(tmp_path / "out", "--checkpoint", str(ckpt), "--tokenizer", str(tok), "--prompt", text)
    fill_mask = hf.pipeline("fill-mask", model=model, tokenizer=hf.AutoTokenizer.from_pretrained(tok), top_k=5)
    expected = fill_mask(text)
    expected = [expected] if isinstance(expected[0], dict) else expected  # one list per mask
    ids = record["input_ids"][0]
    assert ids[0] == VOCAB.index("[CLS]") and ids[-1] == VOCAB.index("[SEP]")  # as the pipeline feeds BERT
    positions = [i for i, t in enumerate(ids) if t == VOCAB.index("[MASK]")]
    assert record["predicted_positions"] == "masked" and record["mask_token_id"] == VOCAB.index("[MASK]")
    got = record["predictions"][0]
    assert [p["position"] for p in got] == positions
    for p, want in zip(got, expected, strict=True):
        assert p["ids"] == [w["token"] for w in want]
        assert p["probs"] == pytest.approx([w["score"] for w in want], abs=1e-5)
        assert p["tokens"] == [VOCAB[w["token"]] for w in want]
    if len(positions) == 1:  # the pipeline fills one mask per sequence
        assert record["filled_text"][0] == expected[0][0]["sequence"]
    assert "output_ids" not in record and "sampling" not in record and record["encode_ms"] > 0
    printed = capsys.readouterr().out
    assert "top 5 predictions at masked positions (token id 4)" in printed
    assert f"position {positions[0]}: {VOCAB[expected[0][0]['token']]} " in printed


def test_ids_without_mask_predict_every_position_and_vocab_txt_names_the_mask(bert, tmp_path):
    model, ckpt, tok = bert
    ids = [2, 6, 7, 8, 3]
    record = infer(tmp_path / "plain", "--checkpoint", str(ckpt), "--input_ids", ",".join(map(str, ids)))
    assert record["mask_token_id"] == 103 and record["predicted_positions"] == "all"  # BERT's default id
    top, probs = hf_top5(model, ids, list(range(5)))
    assert_predictions_equal(record["predictions"][0], [
        {"position": i, "ids": t, "probs": p} for i, (t, p) in enumerate(zip(top, probs))])
    assert "tokens" not in record["predictions"][0][0]  # no tokenizer, no tokens

    (ckpt.parent / "with_vocab").mkdir()  # a checkpoint folder beside its vocab.txt knows its [MASK]
    for f in ckpt.iterdir():
        (ckpt.parent / "with_vocab" / f.name).write_bytes(f.read_bytes())
    (ckpt.parent / "with_vocab" / "vocab.txt").write_text((tok / "vocab.txt").read_text())
    ids[2] = VOCAB.index("[MASK]")
    record = infer(tmp_path / "vocab", "--checkpoint", str(ckpt.parent / "with_vocab"),
                   "--input_ids", ",".join(map(str, ids)))
    assert record["mask_token_id"] == 4 and record["predicted_positions"] == "masked"
    top, probs = hf_top5(model, ids, [2])
    assert_predictions_equal(record["predictions"][0], [{"position": 2, "ids": top[0], "probs": probs[0]}])


def test_random_ids_predict_every_position_of_every_row(tmp_path, capsys):
    save_model_config(tiny_config("bert-base-uncased", n_positions=16), tmp_path / "bert.json")
    record = infer(tmp_path / "out", "--model_config", str(tmp_path / "bert.json"), "--num_input_tokens", "10",
                   "--batch_size", "2", "--seed", "1")
    assert 103 not in record["input_ids"][0]  # (seed 0 draws BERT's [MASK] id, and that position alone is predicted)
    assert record["predicted_positions"] == "all"
    assert [[p["position"] for p in row] for row in record["predictions"]] == [list(range(10))] * 2
    assert all(len(p["ids"]) == 5 and p["probs"] == sorted(p["probs"], reverse=True)
               for row in record["predictions"] for p in row)
    printed = capsys.readouterr().out
    assert "every position (no mask token, id 103, in the prompt)" in printed
    assert "… 2 more positions in run.json" in printed  # 8 printed per sequence


@pytest.mark.parametrize("argv,given", [
    (["--num_output_tokens", "3"], "--num_output_tokens"),
    (["--num_output_tokens", "20", "--beam_width", "2"], "--num_output_tokens, --beam_width"),
    (["--temperature", "0", "--stop_tokens", "3"], "--temperature, --stop_tokens"),
])
def test_generation_options_are_refused_for_an_encoder(tmp_path, capsys, argv, given):
    out = tmp_path / "out"
    assert main(["infer", "--model", "bert-base-uncased", "--num_input_tokens", "4", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("syntorch infer: error: bert-base-uncased is an encoder: encoders predict masked tokens in one "
                   f"pass and generate nothing; drop {given}")
    assert not out.exists()


def test_decoders_keep_generating_20_tokens_by_default(tmp_path):
    save_model_config(tiny_config("gpt2", n_layer=1), tmp_path / "gpt.json")
    record = infer(tmp_path / "out", "--model_config", str(tmp_path / "gpt.json"), "--num_input_tokens", "3")
    assert len(record["output_ids"][0]) == 3 + 20


def test_encoder_prompt_longer_than_its_positions_is_refused(tmp_path, capsys):
    save_model_config(tiny_config("bert-base-uncased", n_positions=16), tmp_path / "bert.json")
    out = tmp_path / "out"
    assert main(["infer", "--model_config", str(tmp_path / "bert.json"), "--num_input_tokens", "17",
                 "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == ("syntorch infer: error: 17 prompt tokens exceed the context of "
                                               "tiny-bert-base-uncased (16); shorten the prompt")
    assert not out.exists()


def phases_and_collectives(folder):
    graph = networkx_json.load(folder / "tensor_trace_graph.json")
    phases = {d["phase"] for _, d in graph.nodes(data=True) if d["kind"] != "tensor"}
    return phases, [(d["collective"], d["module"], d["bytes"], d["group"]) for _, d in graph.collectives()]


def test_one_rank_traces_and_exports_the_encode_pass(bert, tmp_path):
    out = tmp_path / "out"
    record = infer(out, *masked_prompt_args(bert), "--visualize_trace", "--chakra", "--hw_config", "h100-sxm",
                   "--comm_debug")
    phases, collectives = phases_and_collectives(out)
    assert phases == {"encode"} and collectives == []
    assert record["predicted"]["latency_ms"] > 0 and "predicted_latency_us" not in record["trace"]
    assert validate_traces(out / "chakra") == []
    for name in ("tensor_trace_graph.png", "comm_debug.json", "chakra/ckpt.0.et"):
        assert (out / name).stat().st_size > 0, name


@pytest.fixture(scope="module")
def tp_runs(bert, tmp_path_factory):
    """run.json and folder of the masked prompt at TP 1 and on 2 real gloo ranks, traced."""
    root = tmp_path_factory.mktemp("tp")
    runs = {}
    for tp in (1, 2):
        out = root / f"tp{tp}"
        runs[tp] = infer(out, *masked_prompt_args(bert), "--tp", str(tp), "--visualize_trace", "--chakra"), out
    return runs


def test_real_tp2_predicts_what_tp1_does(tp_runs):
    (tp1, _), (tp2, out) = tp_runs[1], tp_runs[2]
    assert tp2["tp"] == 2 and tp2["filled_text"] == tp1["filled_text"]
    assert_predictions_equal(tp2["predictions"][0], tp1["predictions"][0])
    phases, collectives = phases_and_collectives(out)
    assert phases == {"encode"}
    n_layer = tp2["model_config"]["n_layer"]
    kinds = [kind for kind, *_ in collectives]
    # Megatron: the vocab-parallel embedding's all-reduce, two per layer, the head's logits all-gathered
    assert kinds == ["all_reduce"] * (1 + 2 * n_layer) + ["all_gather"]
    assert validate_traces(out / "chakra") == []
    assert (out / "tensor_comm_graph.png").stat().st_size > 0


def test_symbolic_tp2_traces_what_the_real_ranks_ran(bert, tp_runs, tmp_path, capsys):
    out = tmp_path / "meta"
    record = infer(out, *masked_prompt_args(bert), "--device", "meta", "--tp", "2", "--visualize_trace",
                   "--chakra", "--hw_config", "h100-sxm", "--comm_debug")
    real, real_out = tp_runs[2]
    assert record["symbolic"] and record["positions"] == [[2, 6]] and record["input_ids"] == real["input_ids"]
    assert not {"predictions", "encode_ms", "filled_text", "output_ids"} & set(record)  # no values on meta
    assert phases_and_collectives(out) == phases_and_collectives(real_out)
    assert validate_traces(out / "chakra") == []
    assert sorted(p.name for p in (out / "chakra").glob("*.et")) == ["ckpt.0.et", "ckpt.1.et"]
    printed = capsys.readouterr().out
    assert "one encode pass traced, predicting the 2 masked positions; predicted latency" in printed
