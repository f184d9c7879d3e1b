"""The schedule's and moved views' shortcuts against plain forms, on a small TP2 x PP4 1F1B plan (stage 2 a copy
of stage 1): collective orders renumbered over the collectives the prepared steps list (not a scan of the graph)
equal counting each group's collectives in node order; a moved view (its tensors' dicts kept where their names
are) equals the copy stage traced micro-batch by micro-batch, and leaves the view it was moved from as it was."""
import copy

import pytest
import torch

from conftest import tiny_config
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.training import trace_stage
from syntorch.workload import trace_workload

CONFIG = tiny_config("gpt2", n_layer=8, vocab_size=200)
PLAN = TrainPlan(tp=2, pp=4, microbatches=5, seq=16, sp=True)


@pytest.fixture(scope="module")
def workload():
    workload = trace_workload(CONFIG, PLAN, torch.float32)  # no durations: a traced stage compares as it is
    assert workload.source == [0, 1, 1, 3]
    return workload


def test_orders_equal_counting_each_groups_collectives(workload):
    for s in range(PLAN.pp):
        graph, counts = workload.stages[s], {}
        for n, d in graph.collectives():
            key = tuple(d["group"])
            assert d["order"] == counts.get(key, 0), (s, n)
            counts[key] = d["order"] + 1
        assert len(counts) > 1 and max(counts.values()) > PLAN.microbatches  # several groups, many a group


def test_moved_view_is_the_stage_traced(workload):
    source, _ = workload.stages.kind_view(1, 0, "op")  # stage 1's step, in its own schedule
    before = copy.deepcopy(dict(source.node_attrs))
    moved, _ = workload.stages.kind_view(2, 0, "op")  # made in stage 2's schedule and moved (shift_view)
    traced = trace_stage(CONFIG, PLAN, 2, replicate=False)  # every micro-batch run on stage 2
    assert moved.node_attrs == traced.node_attrs
    assert moved.graph["pipeline_schedule"] != source.graph["pipeline_schedule"]
    assert any(d["name"].startswith("layers.4.") for _, d in moved.tensors())  # renamed ones
    assert any(moved.node_attrs[n] is d for n, d in source.node_attrs.items())  # kept ones shared
    workload.stages.moved_view(moved, {}, 3)  # moving again reads it, and changes nothing it was made from
    assert dict(source.node_attrs) == before
