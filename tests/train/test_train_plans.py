"""`syntorch train` on the parallel plans: each plan's real run (spawned gloo ranks) gives the losses of one
process on the same global batch, with the same seed, and saves the one process's model as one HuggingFace folder.

Sequences are cut to 24 tokens (the tiny SQuAD items are 31), so no position is padding and every micro-batch,
CP chunk and replica averages as many tokens: the mean of their means is the one process's mean."""
import json

import pytest

from conftest import tiny_config
from syntorch.checkpoints import load_checkpoint
from syntorch.cli import main
from syntorch.config import save_model_config
from train_data import make_model, make_squad, make_tokenizer

STEPS = 3


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_plans")
    return {"root": root, "data": make_squad(root / "squad.json"), "tokenizer": make_tokenizer(root / "tok"),
            "gpt2": make_model(root / "gpt2", "gpt2"), "bert": make_model(root / "bert", "bert-base-uncased")}


def losses(ws, name, *plan, family="gpt2", global_batch=4, model=None):
    """The logged loss of each step of a run of `plan` whose replicas together take `global_batch` rows, and
    the held-out loss at the end (a fifth of the items, evaluated through the plan's stages).
    `model`: the --model-name and --model_config options (default: the family's tiny checkpoint)."""
    save = ws["root"] / name
    replicas = plan_replicas(plan)
    model = model or ["--model-name", str(ws[family])]
    code = main(["train", family, "--data", str(ws["data"]), *model, "--tokenizer",
                 str(ws["tokenizer"]), "--device", "cpu", "--max-seq-length", "24", "--save-dir", str(save),
                 "--max-steps", str(STEPS), "--num-epochs", "1", "--logging-steps", "1", "--learning-rate", "1e-2",
                 "--eval-fraction", "0.2", "--batch-size", str(global_batch // replicas), *plan])
    assert code == 0
    log = json.loads((save / "train_log.json").read_text())
    return [h["loss"] for h in log if "loss" in h] + [log[-1]["eval_loss"]]


def plan_replicas(plan) -> int:
    """dp of a command line's plan: --nproc over tp * pp * cp."""
    value = dict(zip(plan[::2], plan[1::2]))
    degree = int(value.get("--tp", 1)) * int(value.get("--pp", 1)) * int(value.get("--cp", 1))
    return int(value.get("--nproc", 1)) // degree


@pytest.fixture(scope="module")
def one_process(workspace):
    return losses(workspace, "one")


@pytest.mark.parametrize("plan", [
    ("--nproc", "4", "--tp", "2", "--pp", "2", "--microbatches", "2"),
    ("--nproc", "2", "--zero", "1"),
    ("--nproc", "2", "--fsdp"),
    ("--nproc", "2", "--cp", "2"),
], ids=["tp2-pp2", "zero1", "fsdp", "cp2"])
def test_plan_losses_equal_one_process(workspace, one_process, plan):
    got = losses(workspace, "run_" + "_".join(plan).replace("-", ""), *plan)
    assert len(got) == len(one_process) == STEPS + 1
    assert got == pytest.approx(one_process, abs=1e-4), (got, one_process)
    assert one_process[STEPS - 1] < one_process[0]  # the steps update the model: later losses test the updates


def test_tp_pp_checkpoint_is_the_one_process_model(workspace, one_process):
    """The TP2 x PP2 run above put its ranks' parts together into one HuggingFace folder: the one process's."""
    folder = workspace["root"] / "run_nproc_4_tp_2_pp_2_microbatches_2" / "last_model"
    if not folder.is_dir():
        pytest.skip("needs the tp2-pp2 run of test_plan_losses_equal_one_process")
    same_weights(folder, workspace["root"] / "one" / "last_model")


def same_weights(ours, theirs) -> None:
    ours, theirs = load_checkpoint(ours)[1].state_dict(), load_checkpoint(theirs)[1].state_dict()
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-4


def test_bert_tp_pp_losses_equal_one_process_on_the_same_micro_batches(workspace):
    # masked tokens differ in number between rows, so the reference cuts the batch into the same micro-batches
    # (each a mean over its masked tokens) and its replica draws the same masks (one replica in both)
    one = losses(workspace, "bert_one", "--microbatches", "2", family="bert")
    got = losses(workspace, "bert_tp_pp", "--nproc", "4", "--tp", "2", "--pp", "2", "--microbatches", "2",
                 family="bert")
    assert got == pytest.approx(one, abs=1e-4), (got, one)


def test_mixtral_expert_parallel_equals_one_process_and_saves_every_expert(workspace):
    # full rotary (HuggingFace's Mixtral has no partial rotary), 4 experts: 2 per EP rank
    config = workspace["root"] / "mixtral.json"
    save_model_config(tiny_config("mixtral-8x7b", n_kv_head=2, n_experts=4, rotary_dim=0), config)
    model = ["--model-name", "mixtral-8x7b", "--model_config", str(config)]
    one = losses(workspace, "mixtral_one", model=model)
    got = losses(workspace, "mixtral_ep", "--nproc", "2", "--ep", "2", model=model)
    assert got == pytest.approx(one, abs=1e-4), (got, one)
    # rank 0 gathered the other EP rank's experts: the saved model is the one process's
    same_weights(workspace["root"] / "mixtral_ep" / "last_model", workspace["root"] / "mixtral_one" / "last_model")


def test_a_mesh_that_does_not_fill_the_ranks_is_one_line(workspace, capsys):
    code = main(["train", "gpt2", "--data", str(workspace["data"]), "--model-name", str(workspace["gpt2"]),
                 "--tokenizer", str(workspace["tokenizer"]), "--device", "cpu", "--nproc", "3", "--tp", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "tp(2) * pp(1) * cp(1) = 2" in err, err


def test_mixtral_experts_whole_per_rank_under_tp_equal_one_process(workspace):
    # --etp 1 with --tp 2: each expert whole on a rank while attention is TP-sharded (Megatron-Core's ETP)
    config = workspace["root"] / "mixtral_etp.json"
    save_model_config(tiny_config("mixtral-8x7b", n_kv_head=2, n_experts=4, rotary_dim=0), config)
    model = ["--model-name", "mixtral-8x7b", "--model_config", str(config)]
    one = losses(workspace, "mixtral_etp_one", model=model)
    got = losses(workspace, "mixtral_etp", "--nproc", "4", "--tp", "2", "--ep", "2", "--etp", "1", model=model)
    assert got == pytest.approx(one, abs=1e-4), (got, one)
    same_weights(workspace["root"] / "mixtral_etp" / "last_model", workspace["root"] / "mixtral_etp_one" / "last_model")


def test_experts_sharded_over_tp_are_refused_before_training(workspace, capsys):
    code = main(["train", "gpt2", "--data", str(workspace["data"]), "--model-name", "mixtral-8x7b", "--tokenizer",
                 str(workspace["tokenizer"]), "--device", "cpu", "--nproc", "4", "--tp", "2", "--ep", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "add --etp 1" in err, err


def test_sharded_checkpoint_per_plan_loads_merges_and_reloads(workspace, one_process):
    """--save-format sharded writes one file per TP rank of the plan, as `syntorch shard` does: `shard --merge`
    puts it back into one HuggingFace folder holding the one process's model, and `train --model-name` loads
    the shard folder as that model too."""
    import torch

    from syntorch.checkpoints import read_shard_index
    from syntorch.train.loop import TrainOptions, load_model

    got = losses(workspace, "sharded", "--nproc", "2", "--tp", "2", "--save-format", "sharded")
    assert got == pytest.approx(one_process, abs=1e-4)
    folder = workspace["root"] / "sharded" / "last_model"
    index = read_shard_index(folder)
    assert (index.tp, index.pp) == (2, 1) and sorted(index.files) == [0, 1]
    assert (folder / "tokenizer.json").is_file()  # the tokenizer beside the shards
    merged = workspace["root"] / "merged"
    assert main(["shard", "--checkpoint", str(folder), "--merge", "--out", str(merged)]) == 0
    same_weights(merged, workspace["root"] / "one" / "last_model")
    _, model = load_model(TrainOptions(family="gpt2", data="", model_name=str(folder)), "cpu")
    _, want = load_checkpoint(merged)
    for (name, p), q in zip(model.state_dict().items(), want.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name)


def test_merge_takes_a_shard_folder_only(workspace, capsys):
    assert main(["shard", "--checkpoint", str(workspace["gpt2"]), "--merge", "--out",
                 str(workspace["root"] / "nomerge")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--merge takes a shard folder" in err
    assert not (workspace["root"] / "nomerge").exists()
