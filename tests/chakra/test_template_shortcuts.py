"""The Chakra write's shortcuts leave its nodes and bytes as the plain forms make them (issue 24, "Must show" 2),
on a tiny DP2 x TP2 x PP2 run's stage views (sends, recvs, TP and DP collectives) at module and op level:
chakra_nodes' data_deps (one producer's ids taken as they are, a folded view's two among them) against the
nearest unfolded producers found in the graph, its IOInfo text (one tensor's without joins, shape and dtype
text looked up by layout) against json.dumps of the graph's tensors; to_proto's Node (fields set one by one)
against the one its constructor makes; StageTemplate's body (each distinct attribute list serialized once)
against every node serialized whole."""
import json

import pytest
import torch
from chakra.schema.protobuf import et_def_pb2 as et

from conftest import tiny_config
from syntorch.chakra import nodes, writer
from syntorch.chakra.groups import group_ids
from syntorch.chakra.nodes import chakra_nodes, global_metadata, to_proto
from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.graph import TraceGraph
from syntorch.workload import trace_workload

PLAN = TrainPlan(dp=2, tp=2, pp=2, microbatches=4, seq=16, sp=True, zero=1)


@pytest.fixture(scope="module")
def workload():
    return trace_workload(tiny_config("gpt2", n_layer=4), PLAN, torch.float32, load_hw_config("h100-sxm"))


def _views(workload):
    for level in ("module", "op"):
        for stage in range(PLAN.pp):
            yield stage, level, workload.stages.kind_view(stage, 0, level)[0]


def _groups(workload) -> writer.GroupIds:
    mesh = workload.plan.mesh
    return writer.GroupIds(group_ids(ranks for _, ranks in mesh.process_groups(workload.config.tied_head)), mesh)


def _plain_deps(graph) -> list[list[int]]:
    """Each Chakra node's data_deps: the ids of the nearest ops upstream that are not folded away."""
    ids = {n: i for i, n in enumerate(n for n, d in graph.node_attrs.items()
                                      if d["kind"] != "tensor" and not nodes._folded(d))}

    def producers(n) -> set:
        return {i for t in graph.preds[n] for p in graph.preds[t]
                for i in ({ids[p]} if p in ids else producers(p))}
    return [sorted(producers(n)) for n in ids]


def _plain_io(graph, adj) -> tuple[str, str, str]:
    tensors = sorted(adj, key=lambda t: adj[t].get("arg", 0))
    lists = [list(tensors), [graph.node_attrs[t]["shape"] for t in tensors],
             [graph.node_attrs[t]["dtype"] for t in tensors]]
    return tuple(json.dumps(values, separators=(",", ":")) for values in lists)


def _constructed(spec, attrs) -> et.Node:
    """The Node as its constructor makes it, every field given at once."""
    return et.Node(id=spec.id, name=spec.name, type=spec.type, data_deps=spec.data_deps, ctrl_deps=spec.ctrl_deps,
                   duration_micros=spec.duration_micros,
                   inputs=et.IOInfo(values=spec.inputs[0], shapes=spec.inputs[1], types=spec.inputs[2]),
                   outputs=et.IOInfo(values=spec.outputs[0], shapes=spec.outputs[1], types=spec.outputs[2]),
                   attr=[et.AttributeProto(name=name, **{field: value}) for name, field, value in attrs])


def test_nodes_have_the_deps_and_tensors_of_the_graph(workload):
    for _, _, view in _views(workload):
        specs = chakra_nodes(view, _groups(workload).ids)
        unfolded = [n for n, d in view.node_attrs.items() if d["kind"] != "tensor" and not nodes._folded(d)]
        assert len(specs) == len(unfolded) > 0
        assert [s.data_deps for s in specs] == _plain_deps(view)
        assert [s.inputs for s in specs] == [_plain_io(view, view.preds[n]) for n in unfolded]
        assert [s.outputs for s in specs] == [_plain_io(view, view.succs[n]) for n in unfolded]
        assert any(len(s.data_deps) > 1 for s in specs) and any(s.inputs[0].count(",") for s in specs)


def test_a_folded_producers_deps_pass_on_whole():
    """A view of two ops' outputs is folded away: its one reader depends on both (as the plain search finds)."""
    graph = TraceGraph()
    a, b, joined, out = (graph.add_tensor([4], "float32", 16) for _ in range(4))
    for tensor in (a, b):
        graph.add_op("aten::fill", [], [tensor], flops=4, bytes_written=16)
    graph.add_op("aten::view", [a, b], [joined], is_view=True)
    graph.add_op("aten::neg", [joined], [out], flops=4, bytes_read=16, bytes_written=16)
    specs = chakra_nodes(graph, {})
    assert [s.data_deps for s in specs] == _plain_deps(graph) == [[], [], [0, 1]]


def test_to_proto_is_the_constructed_node(workload):
    for _, _, view in _views(workload):
        for spec in chakra_nodes(view, _groups(workload).ids):
            assert to_proto(spec) == _constructed(spec, spec.attrs)
            assert to_proto(spec, attrs=False) == _constructed(spec, [])


def test_template_body_is_every_node_serialized_whole(workload):
    groups, kinds = _groups(workload), {"pg_name": 0, "comm_src": 0, "comm_dst": 0}
    for stage, level, view in _views(workload):
        specs = chakra_nodes(view, groups.ids)
        header = global_metadata(view, "tiny", level, [], True)
        del header.attr[[a.name for a in header.attr].index("rank")]
        origin = workload.kinds.representative(stage, 0)
        template = writer.StageTemplate(specs, header, groups, origin)
        plain = []
        for spec in specs:  # the per-rank attributes last, as pieces of their own (_attr_piece)
            shared = [a for a in spec.attrs if a[0] not in writer.PER_RANK]
            data = _constructed(spec, shared).SerializeToString() + b"".join(
                writer._attr_piece(name, value) for name, _, value in spec.attrs if name in writer.PER_RANK)
            plain += [writer.varint(len(data)), data]
            for name, _, _ in spec.attrs:
                kinds[name] = kinds.get(name, 0) + 1
        assert template.body.tobytes() == b"".join(plain)
        # the representative's own patch is what its body holds at the patched sites
        assert (template._patches([origin])[0] == template.body[template.sites]).all()
    assert min(kinds.values()) > 0  # group ids and peers were patched
