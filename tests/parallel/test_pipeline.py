"""Pipeline stages and schedules, and training-step traces of TP x PP x DP plans on small meshes."""
import json
from collections import Counter

import pytest
import torch
from chakra.schema.protobuf import et_def_pb2 as et
from conftest import tiny_config

from syntorch.errors import UserError
from syntorch.chakra.writer import write_chakra
from syntorch.parallel.pipeline import schedule, stage_layers
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.graph import RankTraces
from syntorch.trace.levels import layer_of
from syntorch.trace.step_schedule import schedule_stage
from syntorch.trace.training import probe_stage, shift_stage, trace_stage, traced_stage_for
from syntorch.chakra.reader import find_traces, read_bytes, read_trace, split_messages
from syntorch.chakra.validator import check_traces
from syntorch.workload import trace_workload, write_workload


def test_stages_are_contiguous_and_balanced():
    assert stage_layers(96, 8) == [range(12 * s, 12 * s + 12) for s in range(8)]
    assert stage_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    with pytest.raises(UserError, match="--pp 5 is larger than the model's 4 layers"):
        stage_layers(4, 5)


@pytest.mark.parametrize("pp,microbatches", [(4, 8), (4, 2), (2, 5)])
def test_schedules_run_each_microbatch_once_forward_before_backward(pp, microbatches):
    for stage in range(pp):
        for kind in ("1f1b", "gpipe"):
            steps = [(k, m) for k, m, chunk in schedule(kind, stage, pp, microbatches) if chunk == 0]
            assert len(steps) == 2 * microbatches  # one chunk without interleaving
            assert sorted(steps) == sorted([(k, m) for k in "FB" for m in range(microbatches)])
            assert all(steps.index(("F", m)) < steps.index(("B", m)) for m in range(microbatches))
            # backwards run in micro-batch order; 1F1B keeps at most pp - stage micro-batches alive
            assert [m for k, m in steps if k == "B"] == list(range(microbatches))
            alive = max(sum(1 for k, _ in steps[:i + 1] if k == "F") - sum(1 for k, _ in steps[:i + 1] if k == "B")
                        for i in range(len(steps)))
            assert alive == (min(pp - stage, microbatches) if kind == "1f1b" else microbatches)


def _nodes_by_members(folder):
    """Every rank's decoded nodes with pg_name replaced by the group's members and attributes sorted, so two
    writers that number groups differently (or order attributes differently) compare equal. IOInfo tensor ids
    are left out: under SP each TP rank reads its own output of the same split (same shapes and deps)."""
    groups = json.loads((folder / "comm_groups.json").read_text())
    out = {}
    for rank, path in find_traces(folder):
        nodes = []
        for n in read_trace(path)[1]:
            attrs = {a.name: getattr(a, a.WhichOneof("value")) for a in n.attr}
            if "pg_name" in attrs:
                attrs["pg_name"] = tuple(groups[attrs["pg_name"]])
            nodes.append((n.id, n.name, n.type, list(n.data_deps), list(n.ctrl_deps), n.duration_micros,
                          n.inputs.shapes, n.inputs.types, n.outputs.shapes, n.outputs.types, sorted(attrs.items())))
        out[rank] = nodes
    return out


def distinct_bodies(folder) -> int:
    """How many rank files differ in their nodes (the header always differs: it names the rank)."""
    return len({b"".join(split_messages(read_bytes(f), f)[1]) for _, f in find_traces(folder)})


@pytest.mark.parametrize("plan,level", [
    (TrainPlan(dp=2, tp=2, pp=2, sp=True, zero=1, microbatches=2, seq=16), "op"),
    (TrainPlan(dp=2, tp=2, pp=2, zero=0, microbatches=3, seq=16, schedule="gpipe"), "module"),
])
def test_ranks_derived_by_symmetry_equal_tracing_each_rank(tmp_path, plan, level):
    config = tiny_config("gpt2", n_layer=4, vocab_size=200)
    traced = RankTraces(plan.mesh.world_size)
    for rank in range(plan.mesh.world_size):
        traced.put(rank, trace_stage(config, plan, plan.mesh.coordinate(rank).pp, rank=rank))
    write_chakra(traced, tmp_path / "each", config.name, level=level)
    summary = write_workload(trace_workload(config, plan, torch.float32), tmp_path / "derived", level=level, progress=False)
    assert summary["distinct_rank_traces"] == distinct_bodies(tmp_path / "derived")
    each, derived = _nodes_by_members(tmp_path / "each"), _nodes_by_members(tmp_path / "derived")
    assert sorted(derived) == list(range(8))
    for rank in range(8):
        assert derived[rank] == each[rank], f"rank {rank}"
    assert check_traces(tmp_path / "derived")[0] == []


def _comm_nodes(folder):
    found = Counter()
    for rank, path in find_traces(folder):
        for n in read_trace(path)[1]:
            found[(rank, n.type)] += n.type in (et.COMM_SEND_NODE, et.COMM_RECV_NODE)
    return found


@pytest.mark.parametrize("base", ["gpt2", "gptj-6b", "bert-base-uncased"])
def test_every_family_validates_and_every_send_has_its_recv(tmp_path, base):
    config = tiny_config(base, n_layer=5, vocab_size=200)
    plan = TrainPlan(dp=1, tp=2, pp=4, sp=base != "bert-base-uncased", microbatches=3, seq=16)
    write_workload(trace_workload(config, plan), tmp_path, level="module", progress=False)
    assert check_traces(tmp_path)[0] == []
    sends = _comm_nodes(tmp_path)
    for rank in range(8):
        stage = plan.mesh.coordinate(rank).pp
        links = (stage > 0) + (stage < plan.pp - 1)  # each link carries 3 activations one way, 3 grads back
        assert sends[(rank, et.COMM_SEND_NODE)] == sends[(rank, et.COMM_RECV_NODE)] == 3 * links


@pytest.mark.parametrize("sp", [False, True])
def test_per_layer_collectives_are_megatrons(sp):
    config = tiny_config("gpt2", n_layer=4, vocab_size=200)
    plan = TrainPlan(tp=2, pp=2, sp=sp, microbatches=2, micro_batch_size=2, seq=16)
    graph = trace_stage(config, plan, 1)
    per_layer = Counter((layer_of(d["module"]), d["phase"], d["collective"], d["bytes"])
                        for _, d in graph.collectives() if layer_of(d["module"]).startswith("layers."))
    full = 2 * 16 * config.d_model * 4  # b * s * h * fp32 bytes
    expected = ({("forward", "reduce_scatter", full): 4, ("forward", "all_gather", full): 4,
                 ("backward", "all_gather", full): 4, ("backward", "reduce_scatter", full): 4} if sp else
                {("forward", "all_reduce", full): 4, ("backward", "all_reduce", full): 4})  # 2 per layer, 2 mbs
    assert {k[1:]: n for k, n in per_layer.items() if k[0] == "layers.2"} == expected


def test_schedule_is_encoded_as_dependencies():
    config = tiny_config("gpt2", n_layer=4, vocab_size=200)
    plan = TrainPlan(pp=2, microbatches=3, seq=16)
    graph = trace_stage(config, plan, 0)
    assert graph.graph["pipeline_schedule"] == ["F0", "F1", "B0", "F2", "B1", "B2"]
    tokens = [t for t, d in graph.tensors() if d["name"].startswith("schedule[")]
    assert len(tokens) == 6  # one per step after the first, and one before the optimizer
    # without the tokens the second forward would depend on nothing of the first; with them it does
    import networkx as nx
    first_send = next(n for n, d in graph.collectives() if d["collective"] == "send")
    second_embedding = [n for n, d in graph.ops() if d["module"] == "tok_emb" and d["phase"] == "forward"][-1]
    assert nx.has_path(graph, first_send, second_embedding)
    graph.remove_nodes_from(tokens)
    assert not nx.has_path(graph, first_send, second_embedding)


def test_middle_stages_derived_by_shifting_equal_tracing_them():
    config = tiny_config("gpt2", n_layer=7, vocab_size=200)  # stages of 2, 2, 2, 1 layers
    plan = TrainPlan(dp=2, tp=2, pp=4, sp=True, zero=2, microbatches=3, seq=16)
    assert traced_stage_for(config, plan) == [0, 1, 1, 3]
    probe, blocks = probe_stage(config, plan, 1)
    derived = schedule_stage(shift_stage(probe, plan.mesh, 2, 2), blocks, plan)  # its own 1F1B warm-up
    traced = trace_stage(config, plan, 2, replicate=False)
    assert dict(derived.nodes(data=True)) == dict(traced.nodes(data=True))
    assert list(derived.edges(data=True)) == list(traced.edges(data=True))
    assert derived.graph == traced.graph
    assert any(d["module"].startswith("layers.4.") for _, d in derived.ops())


@pytest.mark.parametrize("schedule_kind", ["1f1b", "gpipe"])
def test_microbatches_replicated_from_a_probe_equal_running_them_all(schedule_kind):
    config = tiny_config("gpt2", n_layer=4, vocab_size=200)
    plan = TrainPlan(dp=2, tp=2, pp=2, sp=True, zero=2, bucket_mb=0.02, microbatches=6, seq=16, schedule=schedule_kind)
    for stage in range(2):
        replicated, ran = trace_stage(config, plan, stage), trace_stage(config, plan, stage, replicate=False)
        assert sum(1 for _, d in ran.collectives() if d["collective"] == "send") == 6  # every micro-batch ran
        assert dict(replicated.nodes(data=True)) == dict(ran.nodes(data=True))
        assert list(replicated.edges(data=True)) == list(ran.edges(data=True))
        assert replicated.graph == ran.graph
