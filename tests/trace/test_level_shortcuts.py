"""The stage views' shortcuts against the plain definitions they replace, on small scheduled steps with
tensor-parallel collectives (sequence parallel: views and free ops between the ops and their collectives)."""
import pytest
import torch

from conftest import tiny_config
from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.cost import kernel_of, kernel_us
from syntorch.trace.levels import launches_nothing, _runs, layer_of
from syntorch.workload import trace_workload

HW = load_hw_config("a100-80gb")


@pytest.fixture(scope="module")
def workload():
    plan = TrainPlan(tp=2, pp=4, dp=2, zero=1, microbatches=4, seq=16, sp=True)  # stage 2: a copy of stage 1
    return trace_workload(tiny_config("gpt2", n_layer=4), plan, torch.float32, HW)


@pytest.fixture(scope="module")
def graphs(workload):
    return [workload.stages.kind_graph(s, 0) for s in range(workload.plan.pp)]


def _feeds(graph, node) -> bool:
    """Does a collective read node's output, directly or through ops that launch nothing? (asked per op)"""
    return any(graph.node_attrs[r]["kind"] == "collective" or (launches_nothing(graph.node_attrs[r]) and
                                                               _feeds(graph, r))
               for t in graph.succs[node] for r in graph.succs[t])


def _reads(graph, node) -> bool:
    return any(graph.node_attrs[p]["kind"] == "collective" for t in graph.preds[node] for p in graph.preds[t])


def _plain_runs(graph, key) -> list[list[int]]:
    """_runs as it asked each op whether it reads or feeds a collective."""
    runs, last = [], None
    for node, d in graph.work():
        here = (key(d), d["phase"]) if d["kind"] == "op" else None
        feeding = here is not None and _feeds(graph, node)
        if here is None or here != last or _reads(graph, node) or (feeding and launches_nothing(d)):
            runs.append([])
        runs[-1].append(node)
        last = None if feeding else here
    return runs


@pytest.mark.parametrize("key", [lambda d: d["module"], lambda d: layer_of(d["module"])], ids=["module", "layer"])
def test_runs_walked_back_from_collectives_are_the_runs_asked_per_op(graphs, key):
    for graph in graphs:
        work = [n for n, _ in graph.work()]
        free_feeders = [n for n in work if launches_nothing(graph.node_attrs[n]) and _feeds(graph, n)]
        assert free_feeders  # the case the walk through ops that launch nothing is for
        runs = _runs(graph, key)
        assert runs == _plain_runs(graph, key)
        # _collapse tells a run's members by their range: a run is every op and collective in its range
        assert all(members == [n for n in work if members[0] <= n <= members[-1]] for members in runs)


def test_moved_view_costs_each_collective_as_alone(workload):
    assert workload.source[2] == 1
    view, _ = workload.stages.kind_view(2, 0, "module")  # moved from stage 1's, its collectives costed again
    costed = [(d["duration_us"], kernel_us(kernel_of(view, n, {}), HW, *workload.stages.software))
              for n, d in view.collectives()]
    assert len(costed) > 10 and all(a == b for a, b in costed)
