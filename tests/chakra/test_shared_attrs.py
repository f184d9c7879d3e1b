"""chakra_nodes gives ops of equal FLOPs, bytes and duration one attribute list (StageTemplate serializes it once,
found by the list: tests/chakra/test_template_shortcuts.py checks its bytes): every node's attributes are still the ones the graph gives it, read plainly node by node
(issue 24, "Must show" 2), on a tiny DP2 x TP2 x PP2 run's stage views at module and op level."""
import pytest
import torch

from conftest import tiny_config
from syntorch.chakra import nodes
from syntorch.chakra.groups import group_ids
from syntorch.chakra.nodes import chakra_nodes
from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.workload import trace_workload

PLAN = TrainPlan(dp=2, tp=2, pp=2, microbatches=4, seq=16, sp=True, zero=1)


@pytest.fixture(scope="module")
def views():
    workload = trace_workload(tiny_config("gpt2", n_layer=4), PLAN, torch.float32, load_hw_config("h100-sxm"))
    mesh = workload.plan.mesh
    ids = group_ids(ranks for _, ranks in mesh.process_groups(workload.config.tied_head))
    return ids, [workload.stages.kind_view(stage, 0, level)[0] for level in ("module", "op") for stage in range(PLAN.pp)]


def _plain_attrs(graph) -> list[list[tuple]]:
    """Each unfolded op's attributes from its own graph node, and where each node says its phase."""
    out, phase = [], None
    for d in graph.node_attrs.values():
        if d["kind"] == "tensor" or nodes._folded(d):
            continue
        attrs = []
        if d["kind"] == "op":
            attrs = [("num_ops", "int64_val", max(d["flops"], 1)),
                     ("tensor_size", "uint64_val", d["bytes_read"] + d["bytes_written"])]
        attrs.append(("is_cpu_op", "bool_val", False))
        if d.get("phase") != phase:
            phase = d.get("phase")
            attrs.append(("phase", "string_val", phase or ""))
        if d.get("duration_us"):
            attrs.append(("duration_ns", "uint64_val", round(d["duration_us"] * 1e3)))
        out.append(attrs)
    return out


def test_shared_attribute_lists_are_each_nodes_own(views):
    ids, graphs = views
    for graph in graphs:
        specs = chakra_nodes(graph, ids)
        plain = _plain_attrs(graph)
        assert len(specs) == len(plain)
        for spec, attrs in zip(specs, plain):
            if spec.type == nodes.et.COMP_NODE:
                assert spec.attrs == attrs
            else:  # a communication node: its own comm attributes, then what every node has
                assert [a for a in spec.attrs if a[0] in ("is_cpu_op", "phase", "duration_ns")] == attrs
        shared = len({id(s.attrs) for s in specs})
        assert shared < len(specs) / 2  # lists are shared
        assert sum(a[0] == "phase" for s in specs for a in s.attrs) >= 2  # phases change, each said once

