"""Megatron-Core's --overlap_grad_reduce and --overlap_param_gather on a DP2 step: what overlap hides is the
reduction (or gather) time that runs exposed without it."""
import dataclasses

import pytest
import torch
from conftest import tiny_config

from syntorch.cli import main
from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.simulate.prediction import predict_training
from syntorch.trace.training import trace_stage
from syntorch.workload import trace_workload

A100 = load_hw_config("a100-80gb")
CONFIG = tiny_config("gpt2", n_layer=6, d_model=256, n_head=4, d_head=64, d_ff=1024, vocab_size=128)
PLAN = TrainPlan(dp=2, microbatches=2, seq=64, bucket_mb=1.0)  # ~10 buckets to overlap


def predicted(plan):
    # every layer probed: the graph holds every bucket (a probe of fewer layers predicts the same)
    workload = trace_workload(CONFIG, plan, torch.bfloat16, A100, schedule=False, layer_probes=False)
    return predict_training(workload.probes, workload.source, plan, A100).summary, workload.probes[0][0]


def test_without_overlap_the_step_is_longer_by_the_exposed_gradient_reduction():
    on, _ = predicted(PLAN)
    off, graph = predicted(dataclasses.replace(PLAN, overlap_grad_reduce=False))
    reduce_us = sum(d["duration_us"] for _, d in graph.collectives() if d["phase"] == "backward")
    # without overlap the reduction is exposed but for the flattening of the next bucket, which runs beside
    # it; with it, only what follows the last gradient
    assert 0.8 * reduce_us < off["exposed_comm_s"] * 1e6 <= reduce_us
    assert on["exposed_comm_s"] < 0.8 * off["exposed_comm_s"]
    assert (off["step_s"] - on["step_s"]) == pytest.approx(off["exposed_comm_s"] - on["exposed_comm_s"], rel=0.02)


def test_without_overlap_every_bucket_follows_the_last_gradient():
    graph = trace_stage(CONFIG, dataclasses.replace(PLAN, overlap_grad_reduce=False), 0, torch.bfloat16)
    backward = [n for n, d in graph.node_attrs.items() if d["kind"] == "op" and d["phase"] == "backward"
                and d["name"].startswith("aten.mm")]
    reduces = [n for n, d in graph.collectives() if d["phase"] == "backward"]
    assert len(reduces) > 1 and min(reduces) > max(backward)
    on = trace_stage(CONFIG, PLAN, 0, torch.bfloat16)
    assert min(n for n, d in on.collectives() if d["phase"] == "backward") < max(
        n for n, d in on.node_attrs.items() if d["kind"] == "op" and d["phase"] == "backward")


def test_overlapped_param_gather_moves_zero_all_gathers_into_the_next_forward():
    plan = dataclasses.replace(PLAN, zero=2)
    after, graph_after = predicted(plan)
    overlapped, graph = predicted(dataclasses.replace(plan, overlap_param_gather=True))
    gathers = {d["phase"] for _, d in graph.collectives() if d["collective"] == "all_gather"}
    assert gathers == {"forward"} and {d["phase"] for _, d in graph_after.collectives()
                                       if d["collective"] == "all_gather"} == {"optimizer"}
    assert overlapped["step_s"] < after["step_s"]


def test_the_flags_take_true_or_false(tmp_path, capsys):
    assert main(["trace", "--overlap_grad_reduce", "maybe", "--out", str(tmp_path / "x")]) == 2
    assert "--overlap_grad_reduce: expected true or false, got 'maybe'" in capsys.readouterr().err


def real_rank(out_dir: str) -> None:
    """Two ZeRO-2 steps on this rank with and without the parameter-gather overlap; losses and weights."""
    import json

    from plan_steps import global_batch
    from syntorch.parallel import plans
    from syntorch.parallel.launch import init_distributed
    from syntorch.parallel.mesh import init_groups

    rank, _ = init_distributed("cpu")
    small = tiny_config("gpt2", n_layer=2, vocab_size=200)
    plan = TrainPlan(dp=2, zero=2, microbatches=1, micro_batch_size=2, seq=16, lr=1e-2, bucket_mb=0.01)
    groups = init_groups(plan.mesh, small.tied_head)
    x, y = global_batch(small, plan)
    mine = [(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])]
    out = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        run = plans.apply_plans(small, dataclasses.replace(plan, overlap_param_gather=overlap), groups, "cpu")
        losses = [plans.train_step(run, mine).item() for _ in range(3)]
        run.grad_sync.gather_stale()  # what the next forward would gather, now
        out[str(overlap)] = {"losses": losses, "weights": [p.detach().sum().item() for p in run.model.parameters()]}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(out, f)


def test_real_steps_with_the_gather_overlapped_equal_those_without(tmp_path):
    import json

    from syntorch.parallel.launch import spawn

    spawn(real_rank, 2, (str(tmp_path),))
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["True"]["losses"] == pytest.approx(r["False"]["losses"], abs=1e-6)
        assert r["True"]["losses"][2] < r["True"]["losses"][0]  # the updates reached the forwards
        assert r["True"]["weights"] == pytest.approx(r["False"]["weights"], abs=1e-5)
