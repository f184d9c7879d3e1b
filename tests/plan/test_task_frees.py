"""A search task leaves nothing of its probes behind: the tracer hands what it made to the oldest generation
unscanned (graph.no_gc), where the cycles among it (optimizers, their closures and states) would wait for a full
pass that the CLI's thresholds make rare; a worker, `--workers 1` or a Ray task runs hundreds of tasks
(~100 MB each for Llama-3.1 405B), so evaluate_group frees them when it ends."""
import gc

import torch
from conftest import tiny_config

from syntorch.cli import COLLECTOR_THRESHOLDS
from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.plan.evaluate import evaluate_group


def optimizers_alive() -> int:
    return sum(isinstance(o, torch.optim.Optimizer) for o in gc.get_objects())


def test_a_search_task_frees_its_probes_optimizers():
    config = tiny_config("gpt2", n_layer=8, d_model=64, n_head=2, d_head=32, d_ff=256, vocab_size=128)
    plan = TrainPlan(tp=2, sp=True, pp=2, dp=2, zero=1, microbatches=4, seq=32)
    thresholds = gc.get_threshold()
    gc.collect()
    before = optimizers_alive()
    try:
        gc.set_threshold(*COLLECTOR_THRESHOLDS)
        (index, summary, refusal), = evaluate_group(config, "float32", "fused", "flash",
                                                     [(0, plan, load_hw_config("a100-80gb"))])
        left = optimizers_alive() - before
    finally:
        gc.set_threshold(*thresholds)
    assert summary is not None and summary["step_s"] > 0 and refusal is None
    assert left == 0
