"""Megatron's pipeline scatter/gather between TP ranks: each TP rank sends 1/t of the stream (and of its
gradient) and the receiving stage all-gathers it over TP. Symbolic traces against the whole-tensor sends,
and real TP2 x PP2 steps (1F1B and interleaved) on four gloo ranks against one process."""
import dataclasses
import json

import pytest
import torch
from conftest import tiny_config
from plan_steps import global_batch, reference_step

from syntorch.parallel.plans import TrainPlan
from syntorch.trace.step_schedule import schedule_stage
from syntorch.trace.training import probe_stage, shift_stage, trace_stage

CONFIG = tiny_config("gpt2", n_layer=4, vocab_size=200)
PLAN = TrainPlan(tp=2, pp=2, microbatches=2, micro_batch_size=2, seq=16, lr=1e-2)


def pipeline_comm(graph, tp_group):
    """(p2p sends/recvs, all-gathers over the stage's TP group) as (kind, bytes, phase)."""
    p2p = [(d["collective"], d["bytes"], d["phase"]) for _, d in graph.collectives()
           if d["collective"] in ("send", "recv")]
    gathers = [(d["bytes"], d["phase"]) for _, d in graph.collectives()
               if d["collective"] == "all_gather" and d["group"] == tp_group]
    return p2p, gathers


@pytest.mark.parametrize("virtual", [1, 2])
def test_stages_send_one_tp_part_and_the_receiver_all_gathers_it(virtual):
    scattered = dataclasses.replace(PLAN, virtual_stages=virtual)
    whole = dataclasses.replace(scattered, scatter_gather=False)
    stream = PLAN.micro_batch_size * PLAN.seq * CONFIG.d_model * 4  # [B, T, d] fp32
    for stage in range(PLAN.pp):
        tp_group = PLAN.mesh.group(PLAN.mesh.representative(stage), "tp")
        (p2p, gathers), (p2p_whole, gathers_whole) = (
            pipeline_comm(trace_stage(CONFIG, plan, stage, torch.float32), tp_group) for plan in (scattered, whole))
        assert [b for _, b, _ in p2p_whole] == [stream] * len(p2p_whole)
        assert p2p == [(kind, b // PLAN.tp, phase) for kind, b, phase in p2p_whole]
        # one all-gather of the whole stream per recv, in the recv's phase, beside TP's own all-gathers
        received = sorted((stream, phase) for kind, _, phase in p2p if kind == "recv")
        extra = list(gathers)
        for g in gathers_whole:
            extra.remove(g)
        assert sorted(extra) == received and received


def test_sequence_parallel_and_the_flag_send_the_whole_stream():
    """Under sequence parallel the stream is split already (Megatron skips scatter/gather then)."""
    for plan in (dataclasses.replace(PLAN, sp=True), dataclasses.replace(PLAN, scatter_gather=False)):
        graph = trace_stage(CONFIG, plan, 0, torch.float32)
        share = PLAN.seq // PLAN.tp if plan.sp else PLAN.seq
        assert {d["bytes"] for _, d in graph.collectives() if d["collective"] in ("send", "recv")} == {
            PLAN.micro_batch_size * share * CONFIG.d_model * 4}


def test_scattered_stages_derived_by_shifting_and_replicating_equal_tracing_them():
    """The trace's shortcuts (micro-batches copied from a probe, a middle stage as another's shifted copy) keep
    the all-gathers right: their stage's TP group, their place in the schedule."""
    config = tiny_config("gpt2", n_layer=8, vocab_size=200)
    plan = TrainPlan(dp=2, tp=2, pp=4, microbatches=5, seq=16)
    probe, blocks = probe_stage(config, plan, 1)
    for derived, stage in ((schedule_stage(probe, blocks, plan), 1),
                           (schedule_stage(shift_stage(probe, plan.mesh, 2, 2), blocks, plan), 2)):
        traced = trace_stage(config, plan, stage, replicate=False)
        assert dict(derived.nodes(data=True)) == dict(traced.nodes(data=True))
        assert list(derived.edges(data=True)) == list(traced.edges(data=True))


# --- real steps: TP2 x PP2 on four gloo ranks -------------------------------------------------------------

REAL = [PLAN, dataclasses.replace(PLAN, virtual_stages=2), dataclasses.replace(PLAN, scatter_gather=False)]


def real_rank(out_dir: str) -> None:
    from syntorch.parallel import plans
    from syntorch.parallel.launch import init_distributed
    from syntorch.parallel.mesh import init_groups
    from syntorch.parallel.tensor import take_shard
    from syntorch.trace.tracer import Tracer

    rank, world = init_distributed("cpu")
    x, y = global_batch(CONFIG, PLAN)
    b = PLAN.micro_batch_size
    batches = [(x[i:i + b], y[i:i + b]) for i in range(0, len(x), b)]
    _, ref_grads, _ = reference_step(CONFIG, PLAN)
    results = []
    for plan in REAL:
        groups = init_groups(plan.mesh, CONFIG.tied_head)  # interleaving adds the last-to-first stage pair
        torch.manual_seed(0)
        run = plans.apply_plans(CONFIG, plan, groups, "cpu")
        with Tracer(run.model, rank=rank, world_size=world, default_phase=None) as tracer:
            loss = plans.train_step(run, batches, tracer.phase)
        error = 0.0
        for name, p in run.model.named_parameters():
            module, _, param = name.rpartition(".")
            full = ref_grads["tok_emb.weight" if name == "lm_head.weight" else name]
            ref = take_shard(run.tp_plan.styles.get(module, "replicated"), param, full, groups.tp_rank, plan.tp,
                             run.tp_plan.padded_vocab, CONFIG.d_head)
            error = max(error, (p.grad - ref).abs().max().item())
        results.append({"loss": None if loss is None else loss.item(), "grad_err": error,
                        "collectives": [[d["collective"], d["group"], d["bytes"], d["phase"]]
                                        for _, d in tracer.graph.collectives()]})
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)


def test_real_tp2_pp2_steps_equal_one_process(tmp_path):
    from syntorch.parallel.launch import spawn

    spawn(real_rank, 4, (str(tmp_path),))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    ref_loss = reference_step(CONFIG, PLAN)[0]
    for i, plan in enumerate(REAL):
        assert [r[i]["loss"] is None for r in ranks] == [True, True, False, False]  # stage 1 holds the loss
        assert ranks[2][i]["loss"] == pytest.approx(ref_loss, abs=1e-5) == ranks[3][i]["loss"]
        for rank, r in enumerate(ranks):
            assert r[i]["grad_err"] < 1e-5, f"{plan} rank {rank}: {r[i]}"
            # the real run's collectives are the symbolic trace's (scattered sends and their all-gathers)
            symbolic = trace_stage(CONFIG, plan, PLAN.mesh.coordinate(rank).pp, torch.float32, rank=rank)
            assert r[i]["collectives"] == [[d["collective"], d["group"], d["bytes"], d["phase"]]
                                           for _, d in symbolic.collectives()]


def test_trace_command_takes_megatrons_flag(tmp_path):
    from syntorch.cli import main
    from syntorch.config import save_model_config

    save_model_config(CONFIG, tmp_path / "tiny.json")
    sends = {}
    for flag in ([], ["--no-scatter-gather-tensors-in-pipeline"]):
        out = tmp_path / f"run{len(flag)}"
        assert main(["trace", "--model_config", str(tmp_path / "tiny.json"), "--tp", "2", "--pp", "2", "--seq", "16",
                     "--microbatches", "2", "--out", str(out), "--no_progress", *flag]) == 0
        summary = json.loads((out / "summary.json").read_text())
        sends[len(flag)] = summary["stages"][0]["comm"]["send"]["bytes"]
    assert sends[0] * 2 == sends[1] > 0
