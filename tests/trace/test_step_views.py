"""step_views.scheduled_view (a stage's module or layer view made from views of its probe's steps, without the
scheduled op graph) against level_view of schedule_stage's graph: the same nodes, the same edges in the same
order, the same figures; on stages that run their own probe and on shifted copies of one (moved stages, whose
inputs are in another order), under ZeRO-1 with sequence parallel (collectives that read and feed other steps),
1F1B (steps whose neighbours differ from the probe's: a forward after a backward), interleaved and GPipe."""
import pytest
import torch

from conftest import tiny_config
from graph_checks import edges
from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.levels import level_view
from syntorch.trace.step_schedule import schedule_stage
from syntorch.trace.step_views import StepViews, scheduled_view
from syntorch.workload import node_figures, stage_figures, trace_workload

HW = load_hw_config("h100-sxm")


@pytest.mark.parametrize("level", ["module", "layer"])
@pytest.mark.parametrize("layers,plan", [
    (4, TrainPlan(dp=2, tp=2, pp=2, sp=True, zero=1, microbatches=6, seq=32)),
    # stages 2 and 3 are shifted copies of stage 1, each in its own schedule
    (10, TrainPlan(dp=2, tp=2, pp=5, sp=True, zero=1, microbatches=6, seq=16)),
    (12, TrainPlan(tp=2, pp=3, microbatches=6, seq=16, virtual_stages=2)),
    (6, TrainPlan(dp=2, pp=3, zero=1, microbatches=5, seq=16, schedule="gpipe")),
], ids=["pp2_zero1_sp", "pp5_copies", "interleaved", "gpipe"])
def test_scheduled_view_is_the_scheduled_graph_viewed(layers, plan, level):
    workload = trace_workload(tiny_config("gpt2", n_layer=layers, vocab_size=200), plan, torch.float32, HW,
                              schedule=True)
    views, steps = {}, {}
    for s in range(plan.pp):
        traced = workload.source[s]
        probe, blocks = workload.probes[traced]
        stage = s if traced != s else None  # a shifted copy's: its own schedule, inputs by source
        if (traced, stage is None) not in views:  # one a probe for its own stage, one for its copies
            views[traced, stage is None] = StepViews(probe, level, stage is not None)
        made = scheduled_view(views[traced, stage is None], blocks, plan, stage,
                              steps.setdefault(traced, {}) if stage else None)
        assert made is not None  # (not left to the op graph)
        view, nodes = made
        graph = schedule_stage(probe, blocks, plan, keep=True, stage=stage)
        own = level_view(graph, level)
        assert view.graph == own.graph
        assert view.node_attrs == own.node_attrs
        assert edges(view) == edges(own)
        assert node_figures(nodes, view.graph["pipeline_schedule"]) == stage_figures(graph)
    if plan.pp == 5:
        assert workload.source[2:4] == [1, 1]


def test_kind_view_makes_module_views_from_step_views():
    plan = TrainPlan(dp=2, tp=2, pp=4, sp=True, zero=1, microbatches=6, seq=16)
    workload = trace_workload(tiny_config("gpt2", n_layer=8), plan, torch.float32, HW)
    for s in range(plan.pp):
        view, figures = workload.stages.kind_view(s, 0, "module")
        graph = workload.stages.kind_graph(s, 0)
        assert view.node_attrs == level_view(graph, "module").node_attrs and figures == stage_figures(graph)
    assert set(workload.stages._views) == {(0, 0, "module", False), (1, 0, "module", False),
                                          (1, 0, "module", True), (3, 0, "module", False)}


def test_a_copy_read_otherwise_than_its_probed_step_is_left_to_the_op_graph():
    plan = TrainPlan(dp=2, tp=2, pp=2, sp=True, zero=1, microbatches=6, seq=16)
    workload = trace_workload(tiny_config("gpt2", n_layer=4), plan, torch.float32, HW)
    probe, blocks = workload.probes[0]
    views = StepViews(probe, "module", False)
    assert scheduled_view(views, blocks, plan) is not None
    views.read_outside(("F", 3, 0), *blocks["F", 3, 0]).pop()  # as if the probe's backwards read less of it
    assert scheduled_view(views, blocks, plan) is None
