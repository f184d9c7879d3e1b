"""Context parallelism: the mesh's cp axis, load-balanced chunks, a real CP2 (x DP2) step on gloo ranks
against one process and against its symbolic trace, and CP ranks derived by symmetry."""
import json

import pytest
import torch
from conftest import tiny_config
from plan_steps import global_batch, reference_step
from tests.parallel.test_pipeline import _nodes_by_members, distinct_bodies

from syntorch.chakra.validator import check_traces
from syntorch.chakra.writer import write_chakra
from syntorch.errors import UserError
from syntorch.models import build_model
from syntorch.parallel.context import GatheredKV, apply_cp, chunk_positions
from syntorch.parallel.mesh import Mesh
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.graph import RankTraces
from syntorch.trace.training import trace_stage
from syntorch.workload import trace_workload, write_workload

CONFIG = tiny_config("gpt2", n_layer=4, vocab_size=200)


def test_each_rank_holds_chunk_i_and_its_mirror():
    seq, cp = 16, 2
    parts = [chunk_positions(seq, cp, r).tolist() for r in range(cp)]
    assert parts == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    # causal work (keys each query attends to) is the same on every rank
    assert [sum(p + 1 for p in part) for part in parts] == [sum(p + 1 for p in parts[0])] * cp


@pytest.mark.parametrize("fields,message", [
    (dict(cp=2, seq=18), "--seq 18 does not divide by 4"),
    (dict(cp=0), "--cp must be a positive integer"),
    (dict(cp=2, tp=4, sp=True, seq=12), "make seq / cp divide by tp"),
    (dict(cp=2, mode="infer", seq=16), "drop --cp"),
])
def test_bad_cp_options(fields, message):
    with pytest.raises(UserError, match=message):
        TrainPlan(**fields)


def test_cp_needs_a_causal_model():
    with pytest.raises(UserError, match="attends both ways"):
        TrainPlan(cp=2, seq=16).check(tiny_config("bert-base-uncased"))


def test_cp_gathers_through_its_own_hook_and_never_beside_a_kv_cache():
    """CP's gather goes in each attention's kv_gather, not in the KV-cache slot; a model holding caches (it is
    generating) refuses CP, and a model under CP refuses caches."""
    model = build_model(CONFIG)
    model.setup_caches(1, 8)
    with pytest.raises(UserError, match="holds KV caches"):
        apply_cp(model, group=None)
    model.reset_caches()
    apply_cp(model, group=None)
    assert all(isinstance(b.attn.kv_gather, GatheredKV) and b.attn.kv_cache is None for b in model.layers.values())
    with pytest.raises(AssertionError, match="keeps no KV cache"):
        model.setup_caches(1, 8)


# --- a real step: CP2 x DP2 on four gloo ranks against one process ---------------------------------------

REAL = TrainPlan(dp=2, cp=2, microbatches=2, micro_batch_size=2, seq=16, lr=1e-2)
BASES = ("gpt2", "gptj-6b")  # learned positions and rotary


def real_rank(out_dir: str) -> None:
    from syntorch.parallel import plans
    from syntorch.parallel.launch import init_distributed
    from syntorch.parallel.mesh import init_groups
    from syntorch.trace.tracer import Tracer

    rank, world = init_distributed("cpu")
    results = {}
    for base in BASES:
        config = tiny_config(base, n_layer=2, vocab_size=200)
        groups = init_groups(REAL.mesh, config.tied_head)
        torch.manual_seed(0)
        run = plans.apply_plans(config, REAL, groups, "cpu")
        x, y = global_batch(config, REAL)
        n, b = REAL.microbatches * REAL.micro_batch_size, REAL.micro_batch_size
        dp_idx = REAL.mesh.coordinate(rank).dp
        batches = [(x[i:i + b], y[i:i + b]) for i in range(dp_idx * n, (dp_idx + 1) * n, b)]
        with Tracer(run.model, rank=rank, world_size=world, default_phase=None) as tracer:
            loss = plans.train_step(run, batches, tracer.phase)
        ref_loss, ref_grads, _ = reference_step(config, REAL)
        results[base] = {
            "loss": loss.item(), "ref_loss": ref_loss,
            "grad_err": max((p.grad - ref_grads[name]).abs().max().item() for name, p in run.model.named_parameters()),
            "collectives": [[d["collective"], d["group"], d["bytes"], d["phase"]] for _, d in tracer.graph.collectives()]}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)


def test_real_cp2_dp2_step_equals_one_process_and_the_symbolic_trace(tmp_path):
    from syntorch.parallel.launch import spawn

    spawn(real_rank, 4, (str(tmp_path),))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for base in BASES:
        ranks = [r[base] for r in results]
        # each rank's loss is the mean over its tokens (a quarter of the batch's); their mean is the global one
        assert sum(r["loss"] for r in ranks) / 4 == pytest.approx(ranks[0]["ref_loss"], abs=1e-5)
        for rank, r in enumerate(ranks):
            assert r["grad_err"] < 1e-5, f"{base} rank {rank}: {r['grad_err']}"
            if rank not in (0, 3):  # the others are translations of these (the symmetry test below)
                continue
            symbolic = trace_stage(tiny_config(base, n_layer=2, vocab_size=200), REAL, 0, torch.float32, rank=rank)
            assert r["collectives"] == [[d["collective"], d["group"], d["bytes"], d["phase"]]
                                        for _, d in symbolic.collectives()]
        kinds = {(c[0], tuple(c[1]), c[3]) for c in ranks[0]["collectives"]}
        assert {("all_gather", (0, 1), "forward"), ("reduce_scatter", (0, 1), "backward"),
                ("all_reduce", (0, 1, 2, 3), "backward")} <= kinds  # K/V over CP, gradients over DP x CP


# --- symbolic: every rank traced against ranks derived from the representative ----------------------------

def test_cp_ranks_derived_by_symmetry_equal_tracing_each_rank(tmp_path):
    plan = TrainPlan(dp=2, cp=2, tp=2, sp=True, zero=1, microbatches=2, seq=16)  # dp x cp groups span two axes
    world = plan.mesh.world_size
    traced = RankTraces(world)
    for rank in range(world):
        traced.put(rank, trace_stage(CONFIG, plan, plan.mesh.coordinate(rank).pp, rank=rank))
    write_chakra(traced, tmp_path / "each", CONFIG.name, level="module")
    summary = write_workload(trace_workload(CONFIG, plan, torch.float32), tmp_path / "derived", level="module",
                             progress=False)
    assert summary["distinct_rank_traces"] == distinct_bodies(tmp_path / "derived")
    each, derived = _nodes_by_members(tmp_path / "each"), _nodes_by_members(tmp_path / "derived")
    assert sorted(derived) == list(range(world))
    for rank in range(world):
        assert derived[rank] == each[rank], f"rank {rank}"
    assert check_traces(tmp_path / "derived")[0] == []


def test_middle_stages_under_cp_and_fsdp_derived_by_shifting_equal_tracing_them():
    from syntorch.trace.step_schedule import schedule_stage
    from syntorch.trace.training import probe_stage, shift_stage, traced_stage_for

    config = tiny_config("gpt2", n_layer=7, vocab_size=200)  # stages of 2, 2, 2, 1 layers
    plan = TrainPlan(dp=2, cp=2, pp=4, zero=3, microbatches=3, seq=16)
    assert traced_stage_for(config, plan) == [0, 1, 1, 3]
    probe, blocks = probe_stage(config, plan, 1)
    derived = schedule_stage(shift_stage(probe, plan.mesh, 2, 2), blocks, plan)  # a PP step strides by cp * tp
    traced = trace_stage(config, plan, 2, replicate=False)
    assert dict(derived.nodes(data=True)) == dict(traced.nodes(data=True))
    assert list(derived.edges(data=True)) == list(traced.edges(data=True))


def test_microbatches_replicated_from_a_probe_equal_running_them_all():
    plan = TrainPlan(cp=2, pp=2, microbatches=6, seq=16)  # more micro-batches than a probe runs
    for stage in range(2):
        replicated, ran = trace_stage(CONFIG, plan, stage), trace_stage(CONFIG, plan, stage, replicate=False)
        assert dict(replicated.nodes(data=True)) == dict(ran.nodes(data=True))
        assert list(replicated.edges(data=True)) == list(ran.edges(data=True))


# --- the mesh's cp in predictions: rank counts, syntorch_ranks.json, stream names ----------------------------

def test_ranks_json_records_cp_and_ep_and_predictions_count_every_rank(tmp_path):
    from syntorch.hardware import load_hw_config
    from syntorch.simulate.chakra_files import RANK_KINDS
    from syntorch.simulate.prediction import predict_training

    hw, plan = load_hw_config("h100-sxm"), TrainPlan(dp=2, cp=2, tp=2, pp=2, microbatches=2, seq=16)
    workload = trace_workload(CONFIG, plan, torch.float32, hw)
    write_workload(workload, tmp_path / "run", progress=False)
    written = json.loads((tmp_path / "run" / RANK_KINDS).read_text())["mesh"]
    assert (written["cp"], written["ep"]) == (2, 1) and Mesh(**written) == plan.mesh
    summary = predict_training(workload.probes, workload.source, plan, hw).summary
    assert summary["ranks"] == 16 == sum(kind["ranks"] for kind in summary["rank_kinds"])


def test_cp_collectives_run_on_streams_named_by_their_group():
    from syntorch.simulate.graphs import MeshFrame, graph_program

    plan = TrainPlan(dp=2, cp=2, tp=2, microbatches=1, seq=16)
    graph = trace_stage(CONFIG, plan, 0)
    program, nodes = graph_program(graph, "stage 0", MeshFrame(plan.mesh))
    assert {"comm tp", "comm cp", "comm dp_cp"} == set(program.streams) - {"compute"}  # none is "comm self"
    on_cp = {stream for stream, n in zip(program.streams, nodes) if graph.node_attrs[n].get("group") == [0, 2]}
    assert on_cp == {"comm cp"}  # rank 0's CP group: cp strides by tp
