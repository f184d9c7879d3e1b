"""The write path's shortcuts leave every written file as it was: a copied step's schedule roots taken from
its probed step (step_schedule._Step.roots) instead of found again in each copy, and Chakra nodes made in node
order without a first pass that checks it (chakra_nodes). Files of `syntorch trace`'s write (every rank's,
the summary) with the shortcut and with roots found in every copy, byte for byte, at module and op level,
1F1B and interleaved, with 1, 2 and 8 micro-batches; and a graph out of traced order gets the nodes of its
topological order."""
import filecmp

import networkx as nx
import pytest
import torch

from conftest import tiny_config
from syntorch.chakra import nodes
from syntorch.chakra.nodes import chakra_nodes
from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.simulate.chakra_files import RANK_KINDS
from syntorch.trace import step_schedule
from syntorch.trace.graph import TraceGraph
from syntorch.workload import trace_workload, write_workload


def _written(workload, out, level) -> dict:
    write_workload(workload, out, level, progress=False)
    return {p.name: p for p in out.iterdir() if p.name != RANK_KINDS}  # (it holds the files' modification times)


@pytest.mark.parametrize("plan", [
    TrainPlan(tp=2, pp=4, microbatches=1, seq=16),
    TrainPlan(tp=2, pp=4, microbatches=2, seq=16, sp=True),
    TrainPlan(dp=2, pp=4, microbatches=8, seq=16, zero=1),  # a copied optimizer step and gradient syncs
    TrainPlan(tp=2, pp=2, microbatches=8, seq=16, virtual_stages=2),
], ids=["1f1b_1", "1f1b_2", "1f1b_8", "interleaved_8"])
def test_copied_roots_write_the_files_found_roots_write(plan, tmp_path, monkeypatch):
    config = tiny_config("gpt2", n_layer=8, vocab_size=200)
    workload = trace_workload(config, plan, torch.float32, load_hw_config("a100-80gb"))
    for level in ("module", "op"):
        fast = _written(workload, tmp_path / f"fast_{level}", level)
        with monkeypatch.context() as patch:  # every step's roots found in the scheduled graph
            finish = step_schedule.set_schedule
            patch.setattr(step_schedule, "set_schedule", lambda graph, plan, order, starts, roots=None:
                          finish(graph, plan, order, starts))
            slow = _written(workload, tmp_path / f"slow_{level}", level)
        assert fast.keys() == slow.keys() and len(fast) > plan.mesh.world_size
        assert [name for name in fast if not filecmp.cmp(fast[name], slow[name], shallow=False)] == []


def test_a_graph_out_of_traced_order_gets_its_topological_order():
    graph = TraceGraph()
    late = graph.add_tensor([4], "float32", 16)
    graph.add_op("aten::mul", [late], [graph.add_tensor([4], "float32", 16)], flops=4, bytes_read=16,
                 bytes_written=16)
    x = graph.add_tensor([4], "float32", 16)
    graph.add_op("aten::add", [x], [late], flops=4, bytes_read=16, bytes_written=16)  # made after its reader
    specs = chakra_nodes(graph, {})
    assert [s.name for s in specs] == ["root:aten::add", "root:aten::mul"]  # `late` made before it is read
    assert specs[1].data_deps == [0]
    assert specs == nodes._chakra_nodes(graph, list(nx.topological_sort(graph)), {})
