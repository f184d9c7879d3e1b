"""The search's shortcuts give what the long way gives: a symbolic rank's process groups built alone (so a
16,384-GPU mesh costs what one rank needs) are those of the whole world's that hold it, in the same order;
steps built on a cached probe's own node dicts leave it as it was."""
import pytest
import torch
from conftest import tiny_config

from syntorch.hardware import load_hw_config
from syntorch.parallel.mesh import Mesh
from syntorch.parallel.plans import TrainPlan
from syntorch.plan.evaluate import ProbeCache, predict_plan

A100, H100 = load_hw_config("a100-80gb"), load_hw_config("h100-sxm")

MESHES = [Mesh(dp=2, pp=2, tp=2), Mesh(dp=3, pp=4, tp=2, cp=2, ring=True), Mesh(dp=4, pp=2, tp=2, ep=2),
          Mesh(dp=2, tp=2, cp=2, pp=2, etp=1, ep=8), Mesh(dp=4, tp=2, cp=2, pp=3, ep=4), Mesh(dp=8)]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("tied", (False, True))
def test_one_ranks_groups_are_the_worlds_that_hold_it(mesh, tied):
    every = mesh.process_groups(tied)
    for rank in range(mesh.world_size):
        assert mesh.process_groups(tied, rank) == [(kind, g) for kind, g in every if rank in g]


def test_a_cached_probe_predicts_the_same_after_serving_other_layouts_and_machines():
    """Retargeted and expanded steps share the cached probe's node dicts (layer_probe.expand_step, retarget):
    predicting other pipeline depths on another machine in between leaves a layout's prediction as it was."""
    config = tiny_config("gpt2", n_layer=24, d_model=128, n_head=4, d_head=32, d_ff=512, vocab_size=128)
    sp = dict(tp=2, sp=True, microbatches=8, seq=32, bucket_mb=0.1, zero=1)
    first, other = TrainPlan(pp=2, dp=4, **sp), TrainPlan(pp=4, dp=2, **sp)
    cache = ProbeCache()
    before = predict_plan(config, first, A100, cache, torch.float32).summary
    for hw in (H100, A100):
        predict_plan(config, other, hw, cache, torch.float32)
    assert predict_plan(config, first, A100, cache, torch.float32).summary["step_s"] == before["step_s"]
    assert predict_plan(config, first, A100, ProbeCache(), torch.float32).summary["step_s"] == before["step_s"]
