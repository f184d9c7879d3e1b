"""The cross-rank simulator on hand-made graphs with known answers, and its symmetric form against simulating
every rank (in memory and from Chakra files)."""
import json

import pytest
import torch
from conftest import tiny_config

from syntorch.cli import main
from syntorch.errors import UserError
from syntorch.hardware import load_hw_config
from syntorch.parallel.mesh import Mesh
from syntorch.parallel.pipeline import schedule
from syntorch.parallel.plans import TrainPlan
from syntorch.simulate.chakra_files import predict_traces
from syntorch.simulate.engine import simulate
from syntorch.simulate.graphs import MeshFrame, RankFrame, graph_program, kind_programs
from syntorch.simulate.prediction import predict_inference, predict_training, run_summary
from syntorch.simulate.steps import StepCost, pipeline_programs, step_costs
from syntorch.trace.cost import fill_durations
from syntorch.trace.graph import RankTraces, TraceGraph
from syntorch.trace.training import trace_stage
from syntorch.workload import trace_workload, write_workload

TF, TB = 3.0, 5.0  # µs of one micro-batch's forward and backward on one stage


def op(graph, name, us, after=None):
    """An op of `us` µs that reads `after`'s output (a node id), returning its own."""
    inputs = [graph.add_tensor([1], "float32", 4)] if after is None else [next(iter(graph.succ[after]))]
    return graph.add_op(name, inputs, [graph.add_tensor([1], "float32", 4)], duration_us=us, phase="prefill")


def comm(graph, kind, after, us, **args):
    n = graph.add_collective(kind, [next(iter(graph.succ[after]))], [graph.add_tensor([1], "float32", 4)],
                             nbytes=4, duration_us=us, **args)
    return n


def test_a_collective_waits_for_its_late_rank_and_ends_for_both_together():
    graphs = {}
    for rank, work in ((0, 10.0), (1, 30.0)):
        g = TraceGraph(rank=rank, world_size=2)
        reduced = comm(g, "all_reduce", op(g, "mm", work), 5.0, group=[0, 1])
        op(g, "add", 1.0, reduced)
        graphs[rank] = g
    run = simulate(kind_programs(graphs, RankFrame()))
    assert [run.starts[r][1] for r in (0, 1)] == [30.0, 30.0]  # the all-reduce waits for rank 1
    assert [run.ends[r][1] for r in (0, 1)] == [35.0, 35.0]
    assert run.end_us == 36.0
    stats = run_summary(run)["rank_kinds"]
    assert stats[0]["idle_s"] * 1e6 == pytest.approx(20.0)  # rank 0 waited for rank 1
    assert stats[1]["idle_s"] == 0.0
    assert stats[0]["exposed_comm_s"] * 1e6 == pytest.approx(5.0)


def stage_graph(stage: int, pp: int, order, frame_mesh: Mesh) -> TraceGraph:
    """A stage's step by hand: per schedule step, recv (unless at the pipeline's end), its work, send on."""
    g = TraceGraph(rank=frame_mesh.representative(stage), world_size=frame_mesh.world_size)
    last = None
    for kind, m, _ in order:
        forward = kind == "F"
        peer = stage - 1 if forward else stage + 1
        if 0 <= peer < pp:
            src = frame_mesh.representative(peer)
            last = comm(g, "recv", last if last is not None else op(g, "start", 0.0), 0.0,
                        group=[src, g.graph["rank"]], src=src, tag=2 * m + (not forward))
        last = op(g, f"{kind}{m}", TF if forward else TB, last)
        peer = stage + 1 if forward else stage - 1
        if 0 <= peer < pp:
            dst = frame_mesh.representative(peer)
            comm(g, "send", last, 0.0, group=[g.graph["rank"], dst], dst=dst, tag=2 * m + (not forward))
    return g


def equal_cost(step, virtual: int = 1) -> StepCost:
    """Every stage alike: a forward TF, a backward TB (each chunk 1/virtual of it), all of it compute."""
    us = (TF if step[0] == "F" else TB) / virtual
    return StepCost(us, us)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_a_four_stage_pipeline_takes_the_textbook_m_plus_p_minus_1_steps(kind):
    p, m = 4, 6
    textbook = (m + p - 1) * (TF + TB)
    mesh = Mesh(pp=p)
    graphs = {f"stage {s}": stage_graph(s, p, schedule(kind, s, p, m), mesh) for s in range(p)}
    nodes = simulate(kind_programs(graphs, MeshFrame(mesh)))
    orders = [schedule(kind, s, p, m) for s in range(p)]
    steps = simulate(pipeline_programs(orders, [[equal_cost(step) for step in order] for order in orders], p))
    assert nodes.end_us == steps.end_us == textbook
    summary = run_summary(steps)
    assert summary["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1))
    assert summary["busy_s"] * 1e6 == pytest.approx(m * (TF + TB))


def interleaved(stage: int, pp: int, microbatches: int, virtual: int) -> list[tuple]:
    """Megatron-LM's interleaved 1F1B order (Narayanan et al. 2021), written out for the test: forwards walk
    the chunks in groups of pp micro-batches; warm-up (pp - stage - 1) * 2 + (virtual - 1) * pp steps."""
    def unit(k, forward):
        chunk = (k // pp) % virtual
        return (k // (pp * virtual)) * pp + k % pp, chunk if forward else virtual - 1 - chunk
    total = microbatches * virtual
    warmup = min((pp - stage - 1) * 2 + (virtual - 1) * pp, total)
    steps = [("F", *unit(k, True)) for k in range(warmup)]
    for i in range(total - warmup):
        steps += [("F", *unit(warmup + i, True)), ("B", *unit(i, False))]
    return steps + [("B", *unit(k, False)) for k in range(total - warmup, total)]


@pytest.mark.parametrize("virtual", [2, 4])
def test_interleaving_shrinks_the_bubble_by_the_virtual_stages(virtual):
    p, m = 4, 8
    bubble = {}
    for v in (1, virtual):
        orders = [interleaved(s, p, m, v) for s in range(p)]
        run = simulate(pipeline_programs(orders, [[equal_cost(step, v) for step in order] for order in orders], p, v))
        bubble[v] = run.end_us - m * (TF + TB)
    assert bubble[1] == pytest.approx((p - 1) * (TF + TB))
    assert bubble[virtual] == pytest.approx(bubble[1] / virtual)


def test_a_recv_without_its_send_is_a_deadlock_named():
    g = TraceGraph(rank=0, world_size=2)
    comm(g, "recv", op(g, "mm", 1.0), 1.0, group=[0, 1], src=1, tag=0)
    with pytest.raises(UserError, match="recv .* has no send"):
        simulate(kind_programs({"rank 0": g, "rank 1": TraceGraph(rank=1, world_size=2)}, RankFrame()))


PLAN = TrainPlan(dp=2, tp=2, pp=2, microbatches=3, seq=16)
HW = load_hw_config("a100-80gb")


@pytest.fixture(scope="module")
def tiny():
    return tiny_config("gpt2", n_layer=4)  # a tied head: the embedding all-reduce spans stages 0 and 1


def test_simulating_each_stage_once_equals_simulating_every_rank(tiny):
    mesh = PLAN.mesh
    graphs = {}
    for rank in range(mesh.world_size):
        graphs[rank] = trace_stage(tiny, PLAN, mesh.coordinate(rank).pp, torch.float32, rank=rank)
        fill_durations(graphs[rank], HW)
    every = simulate(kind_programs(graphs, RankFrame()))
    stages = {f"stage {s}": graphs[mesh.representative(s)] for s in range(mesh.pp)}
    symmetric = simulate(kind_programs(stages, MeshFrame(mesh)))
    assert symmetric.end_us == pytest.approx(every.end_us, rel=1e-12)
    for rank in range(mesh.world_size):  # each rank's timeline is its stage representative's
        assert every.ends[rank] == pytest.approx(symmetric.ends[mesh.coordinate(rank).pp], rel=1e-12)
    # the tied embedding's all-reduce meets across stages: drop stage 1 and stage 0 cannot finish
    with pytest.raises(UserError, match="deadlock"):
        simulate([graph_program(stages["stage 0"], "stage 0", MeshFrame(mesh))[0]])


@pytest.mark.parametrize("plan", [PLAN, TrainPlan(dp=2, tp=2, pp=2, sp=True, zero=1, microbatches=2, seq=16),
                                  TrainPlan(dp=2, cp=2, tp=2, pp=2, microbatches=2, seq=16)])
def test_predict_reads_per_stage_files_as_it_reads_every_rank(tiny, tmp_path, plan):
    workload = trace_workload(tiny, plan, torch.float32, HW)
    write_workload(workload, tmp_path / "t", progress=False)
    symmetric = predict_traces(tmp_path / "t")  # the files' durations, replayed in both forms
    assert "one program per pipeline stage" in symmetric.summary["notes"][0]
    assert [p.ranks for p in symmetric.run.programs] == [plan.dp * plan.cp * plan.tp] * 2  # a stage's ranks
    # a rank's file replaced by another rank's of its stage (same size, other groups): every rank is read,
    # and the ranks' collectives no longer meet
    rank5, rank4 = tmp_path / "t" / "tiny-gpt2.5.et", tmp_path / "t" / "tiny-gpt2.4.et"
    original = rank5.read_bytes()
    rank5.write_bytes(rank4.read_bytes())
    with pytest.raises(UserError, match="the simulated ranks deadlock: .*has [0-9]+ of its members"):
        predict_traces(tmp_path / "t")
    rank5.write_bytes(original)  # the right bytes, but a new time: still every rank
    every = predict_traces(tmp_path / "t")
    assert "every rank simulated on its own" in every.summary["notes"][0]
    assert len(every.run.programs) == plan.dp * plan.cp * plan.tp * plan.pp
    assert symmetric.summary["step_s"] == pytest.approx(every.summary["step_s"], rel=1e-12)
    assert symmetric.summary["exposed_comm_s"] == pytest.approx(every.summary["exposed_comm_s"], rel=1e-9)


def test_the_step_level_prediction_agrees_with_the_node_level_one(tiny):
    """Probed steps run in the schedule against every node of every stage's whole step. They differ by a few %:
    a probed step is simulated on its own, so communication it has in flight when it meets another stage (the
    last backward's DP buckets at the tied embedding's all-reduce) resumes after that meeting, not during it."""
    workload = trace_workload(tiny, PLAN, torch.float32, HW)
    steps = predict_training(workload.probes, workload.source, PLAN, HW)
    stages = {f"stage {s}": g for s, g in enumerate(workload.stages)}
    nodes = simulate(kind_programs(stages, MeshFrame(PLAN.mesh)))
    assert steps.summary["step_s"] * 1e6 == pytest.approx(nodes.end_us, rel=0.05)
    # the FLOPs of every scheduled step, copied from the probes, are those of the whole steps' nodes
    traced = {phase: sum(d["flops"] for g in workload.stages for d in g.node_attrs.values()
                         if d["kind"] == "op" and d["phase"] == phase) * PLAN.dp * PLAN.tp
              for phase in ("forward", "backward")}
    assert steps.summary["model_flops"] == 3 * traced["forward"]
    assert steps.summary["hardware_flops"] == traced["forward"] + traced["backward"]


def test_trace_predict_only_writes_a_summary_and_timeline_and_no_chakra(tiny, tmp_path):
    from syntorch.config import save_model_config
    save_model_config(tiny, tmp_path / "tiny.json")
    out = tmp_path / "p"
    assert main(["trace", "--model_config", str(tmp_path / "tiny.json"), "--dp", "2", "--tp", "2", "--pp", "2",
                 "--microbatches", "3", "--seq", "16", "--dtype", "fp32", "--hw_config", "a100-80gb",
                 "--predict_only", "--out", str(out), "--no_progress"]) == 0
    assert not list(out.glob("*.et"))
    predicted = json.loads((out / "summary.json").read_text())["predicted"]
    assert {"step_s", "mfu", "hfu", "bubble_fraction", "exposed_comm_s", "stages", "rank_kinds"} <= set(predicted)
    assert 0 < predicted["mfu"] <= predicted["hfu"] < 1
    events = json.loads((out / "timeline.json").read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"compute", "p2p", "comm embedding"} <= tracks
    slices = [e for e in events if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == 0]
    assert max(e["ts"] + e["dur"] for e in slices) <= predicted["step_s"] * 1e6 + 1e-6


def test_an_inference_pipeline_of_shared_graphs_is_simulated_once_per_graph():
    """Ranks 0, 1 (stage 0) share one graph, ranks 2, 3 (stage 1) another; stage 0's representative sends
    to stage 1's, each TP pair all-reduces among itself: latency = 10 + 2 + 1 (send) + 20 + 2."""
    def stage(rank, first):
        g = TraceGraph(rank=rank, world_size=4)
        if first:
            x = comm(g, "all_reduce", op(g, "mm", 10.0), 2.0, group=[0, 1], phase="prefill")
            comm(g, "send", x, 1.0, group=[0, 2], dst=2, phase="prefill")
        else:
            x = comm(g, "recv", op(g, "start", 0.0), 1.0, group=[0, 2], src=0, phase="prefill")
            comm(g, "all_reduce", op(g, "mm", 20.0, x), 2.0, group=[2, 3], phase="prefill")
        return g
    traces = RankTraces(4)
    traces.put_shared([0, 1], lambda: stage(0, True))
    traces.put_shared([2, 3], lambda: stage(2, False))
    predicted = predict_inference(traces, "test").summary
    assert predicted["latency_ms"] * 1e3 == pytest.approx(35.0)
    assert predicted["prefill_ms"] == predicted["latency_ms"] and predicted["decode_ms_per_token"] == 0.0
    assert [p.ranks for p in predict_inference(traces, "test").run.programs] == [2, 2]


def test_a_scheduled_step_costs_what_the_probed_step_it_copies_costs():
    """4 probed micro-batches (keys with chunks, as an interleaved probe has them) for a step of 8: a step
    probed is itself; later forwards copy the last probed one; the last backward the last probed backward
    (gradient sync), other later backwards a middle one (accumulation)."""
    costs = {(kind, m, c): StepCost(100 * (kind == "B") + 10 * m + c, 0.0)
             for kind in "FB" for m in range(4) for c in range(2)}
    costs["optimizer", None, None] = StepCost(1.0, 1.0)
    steps = [("F", 0, 1), ("F", 6, 0), ("B", 7, 1), ("B", 5, 0), ("B", 1, 1)]
    assert [c.us for c in step_costs(costs, steps, 8)] == [1, 30, 131, 120, 111]


def timed(graph: TraceGraph, durations: list[int]) -> TraceGraph:
    """`graph` with its ops and collectives lasting `durations` µs, in traced order (views 0)."""
    work = [d for _, d in graph.work() if not d.get("is_view")]
    for d, us in zip(work, durations, strict=True):
        d["duration_us"] = us
    return graph


def test_predict_reads_foreign_files_per_rank_with_their_durations(tmp_path):
    """Files without syntorch_ranks.json (here write_chakra's, as a converted capture would be): every rank
    read, its own duration_micros, its collectives meeting the other ranks' and its recv its send."""
    from chakra_graphs import pp_rank, tp_rank
    from syntorch.chakra.writer import write_chakra

    # mm, all_reduce, gelu, all_gather, broadcast, barrier: one chain through compute and one comm stream;
    # rank 1's mm is late, so rank 0 waits for it at the all-reduce
    write_chakra({0: timed(tp_rank(0), [3, 5, 2, 4, 1, 1]), 1: timed(tp_rank(1), [6, 5, 2, 4, 1, 1])}, tmp_path / "tp")
    predicted = predict_traces(tmp_path / "tp").summary
    assert predicted["step_s"] * 1e6 == pytest.approx(6 + 5 + 2 + 4 + 1 + 1)
    assert [k["idle_s"] * 1e6 for k in predicted["rank_kinds"]] == pytest.approx([3.0, 0.0])
    assert "every rank simulated on its own" in predicted["notes"][0]
    # relu 2 us, its send 3 us; the receiver's relu after the data: 2 + 3 + 2
    write_chakra({0: timed(pp_rank(0), [2, 3]), 1: timed(pp_rank(1), [3, 2])}, tmp_path / "pp")
    assert predict_traces(tmp_path / "pp").summary["step_s"] * 1e6 == pytest.approx(7.0)


def test_two_probed_micro_batches_cost_a_step_as_four_do(tiny):
    """--predict_only probes COST_MICROBATCHES (2), its middle backwards derived from the last (one traced
    middle after another in the 4 that copies need): the same prediction."""
    plan = TrainPlan(dp=2, tp=1, pp=2, microbatches=6, seq=16, bucket_mb=0.05)
    workloads = [trace_workload(tiny, plan, torch.float32, HW, schedule=s) for s in (True, False)]
    assert [1 + max(key[1] for key in w.probes[0][1] if key[0] != "optimizer") for w in workloads] == [4, 2]
    four, three = (predict_training(w.probes, w.source, plan, HW).summary for w in workloads)
    assert three["step_s"] == pytest.approx(four["step_s"], rel=1e-12)
    assert three["model_flops"] == four["model_flops"] and three["hardware_flops"] == four["hardware_flops"]


@pytest.mark.parametrize("plan, profile", [
    (TrainPlan(dp=2, pp=2, zero=3, microbatches=2, seq=16), "eager"),  # FSDP: the tied shard's gradient is early
    (TrainPlan(dp=2, tp=2, pp=2, sp=True, microbatches=4, seq=16), "fused")])
def test_a_tied_embedding_ready_before_the_last_stages_send_does_not_deadlock(tiny, plan, profile):
    """The last stage's last backward sends its input's gradient, then all-reduces the tied embedding's with
    stage 0, which needs that gradient to get there. Its inputs may be ready before the send's (FSDP
    reduce-scatters the head's gradient early): the step-level program once issued it first, a deadlock
    ("embedding all_reduce ... has 1 of its members"). Against every node of the whole steps, simulated."""
    workload = trace_workload(tiny, plan, torch.float32, HW, profile=profile)
    steps = predict_training(workload.probes, workload.source, plan, HW, profile)
    names = steps.run.programs[1].names
    assert names.index("embedding all_reduce") > names.index(f"send B{plan.microbatches - 1}")
    nodes = simulate(kind_programs({f"stage {s}": g for s, g in enumerate(workload.stages)}, MeshFrame(plan.mesh)))
    assert steps.summary["step_s"] * 1e6 == pytest.approx(nodes.end_us, rel=0.05)


def test_predict_costs_an_infer_runs_op_level_files_as_the_run_did(tiny, tmp_path):
    """`infer --chakra` writes op-level files; `predict` on them was an IndexError in cost._gemm_shape (the
    graph read from the files had no shapes). They now carry each node's shapes from IOInfo: the same GEMM
    tiles and attention as the run's own prediction. Files that give no shapes cost those kernels by
    their FLOPs and bytes alone."""
    from chakra.src.third_party.utils.protolib import encodeMessage
    from syntorch.chakra.reader import read_trace
    from syntorch.config import save_model_config

    save_model_config(tiny, tmp_path / "tiny.json")
    h100 = load_hw_config("h100-sxm")
    assert main(["infer", "--model_config", str(tmp_path / "tiny.json"), "--num_input_tokens", "8",
                 "--num_output_tokens", "3", "--tp", "2", "--device", "meta", "--chakra", "--hw_config", "h100-sxm",
                 "--out", str(tmp_path / "run")]) == 0
    ran = json.loads((tmp_path / "run" / "run.json").read_text())["predicted"]["latency_ms"]
    assert predict_traces(tmp_path / "run" / "chakra", h100).summary["step_s"] * 1e3 == pytest.approx(ran, rel=1e-3)
    for f in (tmp_path / "run" / "chakra").glob("*.et"):
        header, nodes = read_trace(f)
        with open(f, "wb") as out:
            encodeMessage(out, header)
            for node in nodes:
                node.inputs.shapes = node.outputs.shapes = ""
                encodeMessage(out, node)
    assert predict_traces(tmp_path / "run" / "chakra", h100).summary["step_s"] > 0
