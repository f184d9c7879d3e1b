"""A search task leaves no cycles behind that hold its probes: the tracer hands what it made to the oldest
generation unscanned (graph.no_gc), where a cycle would wait for a full pass that the CLI's thresholds make
rare, and a worker, `--workers 1` or a Ray task runs hundreds of tasks. Two cycles did hold a whole probe (its
model, tracer, graph and optimizer: ~100 MB a Llama-3.1 405B task): the optimizer and the plain step set on it
(nodynamo.plain_step), and the end-of-backward marker a kept-layer probe set on its gradient sync
(training._run_stage)."""
import gc

import pytest
import torch
from conftest import tiny_config

from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.plan.evaluate import evaluate_group

CONFIG = tiny_config("gpt2", n_layer=12, d_model=64, n_head=2, d_head=32, d_ff=256, vocab_size=128)
PLANS = {  # six layers a stage: kept-layer probes (with the marker) but under FSDP with full recomputation
    "ddp": TrainPlan(tp=2, sp=True, pp=2, dp=2, microbatches=4, seq=32),
    "zero1": TrainPlan(tp=2, sp=True, pp=2, dp=2, zero=1, microbatches=4, seq=32),
    "fsdp": TrainPlan(pp=2, dp=2, zero=3, microbatches=4, seq=32),
    "interleaved": TrainPlan(pp=2, dp=2, zero=1, virtual_stages=2, microbatches=4, seq=32),
}


def held(garbage: list) -> list[str]:
    """Names of the probe's objects among `garbage`: modules, optimizers, tensors."""
    return sorted({type(o).__name__ for o in garbage
                   if isinstance(o, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor))})


@pytest.mark.parametrize("name", PLANS)
def test_a_search_task_leaves_no_cycle_holding_its_probes(name):
    gc.collect()
    gc.disable()
    try:
        (_, summary, refusal), = evaluate_group(CONFIG, "float32", "fused", "flash",
                                                 [(0, PLANS[name], load_hw_config("a100-80gb"))])
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = held(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert refusal is None and summary["step_s"] > 0
    assert left == []
