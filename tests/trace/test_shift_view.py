"""A stage written from the stage before it (workload._stage_view: the earlier shifted stage's level view moved
by training.shift_view, its collectives costed again) against the stage's own graph scheduled and viewed: the
same nodes, the same edges in the same order, the same figures."""
import pytest
import torch

from conftest import tiny_config
from graph_checks import edges
from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.workload import _moves_to, _stage_view, trace_workload

HW = load_hw_config("a100-80gb")


@pytest.mark.parametrize("level", ["module", "op"])
def test_a_moved_view_is_the_stage_own(level):
    # TP4 x PP5 with 8 GPUs a node: stage 2 sends within a node, stage 3 across (costing again must see it)
    config, plan = tiny_config("gpt2", n_layer=10, vocab_size=200), TrainPlan(tp=4, pp=5, microbatches=1, seq=16)
    workload = trace_workload(config, plan, torch.float32, HW)
    assert workload.source == [0, 1, 1, 1, 4]
    last = (2, 0, *_stage_view(workload, 2, 0, level, None))
    assert _moves_to(workload, (2, 0), (3, 0)) and not _moves_to(workload, (1, 0), (2, 0))  # 1 is traced
    moved, figures = _stage_view(workload, 3, 0, level, last)
    assert moved.succs is last[2].succs  # made from stage 2's, not traced
    own, own_figures = _stage_view(workload, 3, 0, level, None)
    assert moved.graph == own.graph
    assert moved.node_attrs == own.node_attrs
    assert edges(moved) == edges(own)
    assert figures == own_figures
    sends = [{d["duration_us"] for _, d in view.collectives() if d["collective"] == "send" and d["phase"] == "forward"}
             for view in (last[2], own)]
    assert sends[0] != sends[1]
