"""A stage's view as written (StageGraphs.kind_view: a shifted copy's made as its traced stage's in the
copy's schedule, then moved; the traced stage's probe and its prepared steps serve every copy; a graph
made to be viewed shares the probe's dicts) against the stage's own graph scheduled and viewed
(level_view(kind_graph)): the same nodes, the same edges in the same order, the same figures; with several
micro-batches, interleaved and not, and one, at module and op level."""
import pytest
import torch

from conftest import tiny_config
from graph_checks import edges
from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.levels import level_view
from syntorch.workload import stage_figures, trace_workload

HW = load_hw_config("a100-80gb")


@pytest.mark.parametrize("level", ["module", "op"])
@pytest.mark.parametrize("plan", [
    # TP2 x PP5, 1F1B: stages 2 and 3 are copies of stage 1, each with its own warm-up
    TrainPlan(tp=2, pp=5, microbatches=6, seq=16, sp=True),
    # interleaved: two chunks a stage, stages 2..4 copies of 1
    TrainPlan(tp=2, pp=6, microbatches=6, seq=16, virtual_stages=2),
    # one micro-batch: every stage runs the probe's steps in the probe's order (the probe finished as it is)
    TrainPlan(tp=2, pp=5, microbatches=1, seq=16),
], ids=["1f1b", "interleaved", "one_microbatch"])
def test_each_stage_view_is_its_own_graph_viewed(plan, level):
    config = tiny_config("gpt2", n_layer=10 if plan.virtual_stages == 1 else 12, vocab_size=200)
    workload = trace_workload(config, plan, torch.float32, HW)
    assert len([s for s, t in enumerate(workload.source) if t != s]) >= 2  # shifted copies
    graphs = [workload.stages.kind_graph(s, 0) for s in range(plan.pp)]  # first: views made later must not change them
    for s, graph in enumerate(graphs):  # traced stages too: their views share the probe's dicts
        view, figures = workload.stages.kind_view(s, 0, level)
        own = level_view(graph, level)
        assert view.graph == own.graph
        assert view.node_attrs == own.node_attrs
        assert edges(view) == edges(own)
        assert figures == stage_figures(graph)
    assert list(workload.stages._steps) == [(1, 0)]  # one probe's steps serve every copy
