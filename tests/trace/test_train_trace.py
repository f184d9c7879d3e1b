"""`syntorch trace`: per-rank Chakra of a training step (or pipelined prefill), its summary, and bad input."""
import json
import re

import pytest
from conftest import tiny_config

from syntorch.cli import main
from syntorch.config import save_model_config
from syntorch.chakra.reader import read_trace
from syntorch.chakra.validator import check_traces


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.json"
    save_model_config(tiny_config("gpt2", n_layer=4, vocab_size=200), path)
    return str(path)


def test_trace_command_writes_every_rank_and_a_summary(tmp_path, tiny, capsys):
    out = tmp_path / "run"
    argv = ["trace", "--model_config", tiny, "--dp", "2", "--tp", "2", "--pp", "2", "--sp", "--zero", "1",
            "--microbatches", "4", "--micro_batch_size", "2", "--seq", "32", "--global_batch", "16",
            "--world_size", "8", "--hw_config", "h100-sxm", "--out", str(out), "--no_progress"]
    assert main(argv) == 0
    assert sorted(p.name for p in out.glob("*.et")) == [f"tiny-gpt2.{r}.et" for r in range(8)]
    assert check_traces(out)[0] == []
    summary = json.loads((out / "summary.json").read_text())
    # every rank's file names its own TP/DP groups and peers: 8 distinct traces, from 2 traced stages
    assert summary["distinct_rank_traces"] == 8 and summary["traced_stages"] == 2 and summary["world_size"] == 8
    assert summary["stages"][0]["chakra_nodes"] == len(read_trace(out / "tiny-gpt2.0.et")[1])  # as in the files
    first, last = summary["stages"]
    assert first["ranks"] == [0, 1, 4, 5] and last["ranks"] == [2, 3, 6, 7]
    assert first["schedule"] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert last["schedule"] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert first["comm"]["send"]["count"] == 4 and last["comm"]["recv"]["count"] == 4
    assert all(s["compute_us"] > 0 and s["comm_us"] > 0 for s in summary["stages"])
    groups = json.loads((out / "comm_groups.json").read_text())
    # 4 TP groups, 4 DP groups, 4 stage pairs, and the tied-embedding pairs (the same 4 ranks pairs at pp=2),
    # the model-parallel groups (TP x PP) and the world (the gradient norm's: ZeRO shards the optimizer)
    assert sorted(map(tuple, groups.values())) == sorted({(0, 1), (2, 3), (4, 5), (6, 7), (0, 4), (1, 5), (2, 6),
                                                         (3, 7), (0, 2), (1, 3), (4, 6), (5, 7), (0, 1, 2, 3),
                                                         (4, 5, 6, 7), tuple(range(8))})
    assert "8 ranks" in capsys.readouterr().out
    assert main(argv) == 2  # the folder holds a run now
    assert main([*argv, "--force"]) == 0


def test_pipelined_inference_runs_forwards_only(tmp_path, tiny):
    out = tmp_path / "infer"
    assert main(["trace", "--model_config", tiny, "--mode", "infer", "--tp", "2", "--pp", "2", "--microbatches", "3",
                 "--seq", "16", "--trace_level", "op", "--out", str(out), "--no_progress"]) == 0
    assert check_traces(out)[0] == []
    summary = json.loads((out / "summary.json").read_text())
    for stage in summary["stages"]:
        assert stage["schedule"] == ["F0", "F1", "F2"]
        assert stage["flops"]["backward"] == stage["flops"]["optimizer"] == 0 < stage["flops"]["forward"]


@pytest.mark.parametrize("fields, message", [
    (dict(zero=1), "--zero 1 shards over the data-parallel group; it needs --dp > 1"),
    (dict(dp=2, zero=1, mode="infer"), "drop --zero"),
    (dict(sp=True), "--sp (sequence parallel) splits TP regions along the sequence; it needs --tp > 1"),
    (dict(tp=2, sp=True, seq=33), "--sp needs --seq (33) divisible by --tp (2)"),
    (dict(schedule="zigzag"), "unknown --schedule 'zigzag'"),
])
def test_a_plan_checks_its_own_options_when_made(fields, message):
    from syntorch.errors import UserError
    from syntorch.parallel.plans import TrainPlan
    with pytest.raises(UserError, match=re.escape(message)):
        TrainPlan(**fields)
