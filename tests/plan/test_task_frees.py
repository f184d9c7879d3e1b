"""A search task leaves nothing of its probes behind, with no collection of its own. The tracer hands what it
made to the oldest generation unscanned (graph.no_gc), where a cycle would wait for a full pass that the CLI's
thresholds make rare, and a worker, `--workers 1` or a Ray task runs hundreds of tasks (~100 MB each for
Llama-3.1 405B). Cycles that held a probe's modules, optimizer, tracer or graph, each broken at its root:
- the optimizer and the plain step set on it (nodynamo.plain_step holds it weakly);
- the end-of-backward marker a kept-layer probe set on its gradient sync (training._run_stage removes it);
- a block's forward set on the block under full recomputation (recompute.py), a Linear's under FP8 (fp8.py):
  the module's own forward is held weakly.
One was no cycle the collector could free at all: FSDP's gradient hooks held their unit, and so its
parameters (fsdp.py); torch keeps a parameter's hooks in C++, out of the collector's sight, so every FSDP task
leaked its units, parameters and shards for good. And each process group set up (distributed.symbolic_world)
wrapped sys.excepthook once more, a chain growing by a few closures every stage traced."""
import gc
import sys

import pytest
import torch
from conftest import tiny_config

from syntorch.cli import COLLECTOR_THRESHOLDS
from syntorch.hardware import load_hw_config
from syntorch.nodynamo import skip_dynamo_until_loaded
from syntorch.parallel.fsdp import Unit
from syntorch.parallel.plans import TrainPlan
from syntorch.plan.evaluate import evaluate_group

GPT = tiny_config("gpt2", n_layer=12, d_model=64, n_head=2, d_head=32, d_ff=256, vocab_size=128)
MOE = tiny_config("mixtral-8x22b", n_layer=4, n_kv_head=2, d_ff=64, n_experts=4, n_positions=64)
B = dict(microbatches=4, seq=32)
PLANS = {  # six layers a stage: kept-layer probes (with the marker), whole ones under FSDP with recomputation
    "ddp": (GPT, TrainPlan(tp=2, sp=True, pp=2, dp=2, **B)),
    "zero1": (GPT, TrainPlan(tp=2, sp=True, pp=2, dp=2, zero=1, **B)),
    "zero2_fp32_reduce": (GPT, TrainPlan(pp=2, dp=2, zero=2, grad_reduce_dtype="fp32", **B)),
    "fsdp": (GPT, TrainPlan(pp=2, dp=2, zero=3, **B)),
    "fsdp_not_resharded": (GPT, TrainPlan(tp=2, sp=True, dp=2, zero=3, reshard_after_forward=False, **B)),
    "interleaved": (GPT, TrainPlan(pp=2, dp=2, zero=1, virtual_stages=2, **B)),
    "cp_selective": (GPT, TrainPlan(pp=2, dp=2, cp=2, zero=1, recompute="selective", **B)),
    "full_recompute": (GPT, TrainPlan(tp=2, sp=True, pp=2, dp=2, recompute="full", **B)),
    "fp8": (GPT, TrainPlan(tp=2, sp=True, pp=2, dp=2, zero=1, fp8=True, **B)),
    "moe_ep_fsdp": (MOE, TrainPlan(dp=4, ep=2, zero=3, recompute="full", **B)),
}
PROBE_KINDS = (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, Unit)


def task(name: str, dtype: str = "float32") -> None:
    config, plan = PLANS[name]
    hw = load_hw_config("h100-sxm" if plan.fp8 else "a100-80gb")
    (_, summary, refusal), = evaluate_group(config, "bfloat16" if plan.fp8 else dtype, "fused", "flash",
                                             [(0, plan, hw)])
    assert refusal is None and summary["step_s"] > 0


def probe_objects(objects, kinds=PROBE_KINDS) -> list[str]:
    return sorted({type(o).__name__ for o in objects if issubclass(type(o), kinds)})


def alive(kinds=PROBE_KINDS) -> list:
    return [o for o in gc.get_objects() if issubclass(type(o), kinds)]  # (type(): no deprecated __class__)


def test_a_search_task_leaves_no_module_or_optimizer_alive():
    """As a worker runs them (the CLI's thresholds), task after task of each plan, without a full collection."""
    thresholds = gc.get_threshold()
    gc.collect()
    kinds = (torch.nn.Module, torch.optim.Optimizer)  # (tensors: the meta cache keeps its results)
    before = {id(o) for o in alive(kinds)}
    try:
        gc.set_threshold(*COLLECTOR_THRESHOLDS)
        for name in PLANS:
            task(name)
            now = alive(kinds)
            made = [o for o in now if id(o) not in before]
            assert made == [], (name, probe_objects(made, kinds))
            before = {id(o) for o in now}
    finally:
        gc.set_threshold(*thresholds)


# every plan's task, then one of another kind (order effects: what one leaves may hold the next): ddp after each,
# fsdp after ddp
ORDER = ["ddp", "fsdp"] + [step for name in PLANS if name not in ("ddp", "fsdp") for step in ("ddp", name)] + ["ddp"]


def garbage_probes(before=frozenset()) -> list[str]:
    """The probe kinds among the cyclic garbage a full pass finds (of the objects it scans, not in `before`);
    the garbage is freed after."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return probe_objects(o for o in gc.garbage if id(o) not in before)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.collect()


def test_no_cycle_holds_a_probe():
    """No module, optimizer, tensor or FSDP unit a task made in cyclic garbage, for each task of ORDER. What was
    alive before a task is frozen (gc.freeze), so a pass scans only what the task made: an earlier test's autograd
    graph, held from torch's C++ by its own hooks, was seen freed inside a task in the full suite. A cycle through
    such an older object that died in a task is looked for at the end, over everything made since the first."""
    skip_dynamo_until_loaded()  # (once a process, before the first task: it finds torch's wrappers by
    # gc.get_referrers, which sees no frozen object)
    gc.collect()
    gc.disable()  # (and so the tracer's no_gc freezes nothing: it would unfreeze what this test froze)
    before = {id(o) for o in gc.get_objects()}
    try:
        for name in ORDER:
            gc.freeze()
            task(name, "bfloat16")
            assert garbage_probes() == [], name
        gc.unfreeze()
        assert garbage_probes(before) == []
    finally:
        gc.unfreeze()
        gc.enable()


@pytest.mark.parametrize("name", ["fsdp", "moe_ep_fsdp", "fp8"])
def test_nothing_of_a_task_outlives_it(name):
    """After a task (its kernels' meta results cached by the first), a full collection leaves no module, tensor
    or unit alive that was not alive before it, and sys.excepthook as it was. What was alive before is held here:
    in the full suite an earlier test's object can die inside the task (a count would then hide a leak, or
    fall), and a freed object's id could be a new one's."""
    task(name)
    gc.collect()
    before, hook = alive(), sys.excepthook
    task(name)
    gc.collect()
    known = {id(o) for o in before}
    made = [o for o in alive() if id(o) not in known]
    assert made == [], probe_objects(made)
    assert sys.excepthook is hook
