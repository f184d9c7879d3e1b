"""A stated routing load for symbolic MoE runs (parallel/moe_load.py): parsing and its one-line refusals, the
all-to-all sizes of each EP rank following it (checked against the rows each rank must send and receive when
every rank routes alike), the EP ranks it makes differ (written as their kinds), and the expert GEMMs of a one-rank run."""
import json

import pytest
from conftest import tiny_config

from syntorch.cli import main
from syntorch.config import save_model_config
from syntorch.errors import UserError
from syntorch.parallel.moe_load import ep_kinds, parse_load
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.training import trace_stage

MOE = tiny_config("gpt2", n_layer=2, vocab_size=200, n_experts=4, moe_top_k=2)
ROWS = [[6, 2, 0, 0], [1, 1, 1, 1]]  # layer 0: EP rank 0's experts get every pair; layer 1: uniform


def load_file(tmp_path, data, name="load.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_parse_normalises_rows_and_knows_uniform_and_zipf(tmp_path):
    assert parse_load("uniform", MOE) is None
    assert parse_load(load_file(tmp_path, {"tokens_per_expert": ROWS}), MOE) == ((0.75, 0.25, 0.0, 0.0), (0.25,) * 4)
    zipf = parse_load("zipf:1", MOE)
    assert len(zipf) == 2 and zipf[0] == pytest.approx([12 / 25, 6 / 25, 4 / 25, 3 / 25])  # 1, 1/2, 1/3, 1/4
    assert parse_load("zipf:0", MOE)[1] == pytest.approx([0.25] * 4)


@pytest.mark.parametrize("data, words", [
    ("{not json", "is not valid JSON"),
    ({"tokens_per_expert": [[1, 1, 1, 1]]}, "has 1 rows but tiny-gpt2 has 2 MoE layers"),
    ({"tokens_per_expert": [[1, 1, 1], [1, 1, 1, 1]]}, "MoE layer 0's row has 3 experts but tiny-gpt2 has 4"),
    ({"tokens_per_expert": [[1, -1, 1, 1], [1, 1, 1, 1]]}, "non-negative numbers, not all zero"),
    ({"tokens_per_expert": [[0, 0, 0, 0], [1, 1, 1, 1]]}, "non-negative numbers, not all zero"),
    ({"tokens": ROWS}, "must hold"),
])
def test_bad_load_files_are_one_line(tmp_path, data, words):
    with pytest.raises(UserError, match=words):
        parse_load(load_file(tmp_path, data), MOE)


def test_bad_load_on_the_command_line_exits_2(tmp_path, capsys):
    config = tmp_path / "moe.json"
    save_model_config(MOE, config)
    assert main(["trace", "--model_config", str(config), "--seq", "16", "--moe_load", "zipf:-1",
                 "--out", str(tmp_path / "run")]) == 2
    assert main(["trace", "--model", "gpt3-125m", "--seq", "16", "--moe_load", "zipf:1",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "skew S >= 0" in err[0] and "has none" in err[1]


def row_bytes(rows: int) -> int:
    return rows * MOE.d_model * 4


def test_each_ep_ranks_all_to_alls_follow_the_load(tmp_path):
    """EP 2 (DP 2): rank r holds experts 2r, 2r+1. Every rank routes alike, so it sends share(rank s's experts)
    x N·k rows to each s and receives share(its experts) x N·k from each of the 2 ranks; an all-to-all's size
    is the larger of what a rank sends and receives (trace/collectives.py)."""
    load = parse_load(load_file(tmp_path, {"tokens_per_expert": ROWS}), MOE)
    plan = TrainPlan(dp=2, ep=2, seq=16, micro_batch_size=2, moe_load=load)
    pairs = plan.micro_batch_size * plan.seq * MOE.moe_top_k  # N·k, all sent somewhere
    for rank in (0, 1):
        graph = trace_stage(MOE, plan, 0, rank=rank)
        rows = [d for _, d in graph.collectives() if d["collective"] == "all_to_all" and d["phase"] == "forward"
                and d["bytes"] != 8 * 2 * 2]  # not the counts' exchange ([ep, L] int64)
        for layer, share in enumerate(load):
            received = 2 * sum(share[2 * rank:2 * rank + 2]) * pairs
            mine = [d["bytes"] for d in rows if d["module"].startswith(f"layers.{layer}.")]
            assert mine == [row_bytes(max(pairs, received))] * 2, (rank, layer)  # the rows out and back
    assert ep_kinds(load, 2) == [[0], [1]] and ep_kinds(None, 2) == [[0, 1]]
    assert ep_kinds(parse_load("zipf:0", MOE), 2) == [[0, 1]]


def test_without_ep_the_expert_gemms_follow_the_load(tmp_path):
    """One rank: each expert's fc1 multiplies its share of the N·k pairs (layer 0: 24 and 8 of 32, two idle)."""
    load = parse_load(load_file(tmp_path, {"tokens_per_expert": ROWS}), MOE)
    graph = trace_stage(MOE, TrainPlan(seq=16, moe_load=load), 0)
    fc1 = [d for _, d in graph.node_attrs.items() if d["kind"] == "op" and d["phase"] == "forward"
           and d["module"].startswith("layers.0.mlp.experts.") and d["module"].endswith(".fc1") and d["flops"]]
    rows = sorted(d["flops"] // (2 * MOE.d_model * MOE.expert_d_ff) for d in fc1)
    assert rows == [8, 24]


def test_trace_writes_a_load_that_makes_ep_ranks_differ_as_their_kinds(tmp_path, capsys):
    config = tmp_path / "moe.json"
    save_model_config(MOE, config)
    args = ["trace", "--model_config", str(config), "--seq", "16", "--dp", "2", "--ep", "2", "--no_progress"]
    skewed = load_file(tmp_path, {"tokens_per_expert": ROWS})
    even = load_file(tmp_path, {"tokens_per_expert": [[1, 1, 1, 1], [3, 1, 3, 1]]}, "even.json")
    assert main([*args, "--moe_load", skewed, "--out", str(tmp_path / "a")]) == 0
    assert "written as each pair's sends and recvs, which ASTRA-sim runs" in capsys.readouterr().out
    assert main([*args, "--moe_load", even, "--out", str(tmp_path / "b")]) == 0  # each EP rank's experts get half
    assert "ASTRA-sim" not in capsys.readouterr().out
    summaries = [json.loads((tmp_path / run / "summary.json").read_text()) for run in "ab"]
    assert [s["kinds_per_stage"] for s in summaries] == [2, 1]
    kinds = [s["stages"][0].get("rank_kinds") for s in summaries]
    assert [k["ep_ranks"] for k in kinds[0]] == [[0], [1]] and kinds[1] is None
    assert kinds[0][0]["comm_bytes"] > kinds[0][1]["comm_bytes"]  # EP rank 0's experts get every pair of layer 0
