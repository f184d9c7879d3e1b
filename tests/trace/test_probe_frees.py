"""A probe's stage is freed when the probe returns: the gradient hooks of DDP/ZeRO (buckets.GradSync) and FSDP
(fsdp.FullyShard) hold their owner weakly. Torch keeps a parameter's post-accumulate-grad hooks where the cyclic
collector does not look, so a hook holding its owner kept the owner, its parameters and the whole stage model
alive: ~130 MB a task of a Llama-3.1 405B layout search."""
import gc
import weakref

import pytest
import torch
from conftest import tiny_config

from syntorch.parallel import buckets, fsdp
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.layer_probe import whole_probe


@pytest.mark.parametrize("zero, owner", [(0, buckets.GradSync), (1, buckets.GradSync), (3, fsdp.FullyShard)])
def test_a_probed_stage_leaves_no_gradient_owner_alive(monkeypatch, zero, owner):
    made = []
    init = owner.__init__

    def remembered(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(owner, "__init__", remembered)
    plan = TrainPlan(dp=2, zero=zero, microbatches=2, micro_batch_size=1, seq=16)
    graph, _ = whole_probe(tiny_config("gpt2"), plan, 0, torch.float32, 2)
    assert any(d["kind"] == "collective" for d in graph.node_attrs.values())  # the hooks ran
    gc.collect()
    assert made and all(ref() is None for ref in made)
