"""One layout's predicted step from cached probes: `predict_plan(config, plan, hw, cache)`.

A prediction is the probes of the plan's traced stages (trace/layer_probe.py), their durations on a machine
(trace/cost.fill_durations), and the step-level simulation (simulate/prediction.predict_training). A stage's
probe has two parts, cached apart by what shapes each:

- its kept layers run for COST_MICROBATCHES micro-batches (layer_probe.kept_probe), keyed by `layer_key`: the
  model, the dtype, the plan but its pipeline depth, DP degree (only whether there is DP, unless ZeRO-2/FSDP
  shard by it), micro-batch count and layer split, and the stage's part (per chunk: whether it holds the
  embedding and the loss, its runs of alike layers, layer_probe.kept_per_run kept of each). Layouts that differ
  in PP (and so in DP on a fixed cluster) share it, moved onto their own mesh (trace/retarget.py), with their
  own copy counts;
- the whole stage's end of backward and optimizer step (training.probe_optimizer), keyed by `optimizer_key`:
  the plan but its micro-batch count and size and recomputation, which change no parameter.

A stage that cannot be probed with fewer layers is probed whole, keyed by the plan (`probe_key`) and stage.
Durations are filled per machine on the cached graphs (fill_durations sets every op's and collective's), so
one probe serves every --compare_hw machine; only fill_durations and the simulator run again.
tests/plan/test_shared_probes.py checks that predictions from shared probes are those of fresh ones.
"""
import dataclasses
from collections import OrderedDict

import torch

from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.hardware import HardwareConfig
from syntorch.parallel.plans import TrainPlan
from syntorch.simulate.prediction import Prediction, predict_training
from syntorch.trace.cost import fill_durations
from syntorch.trace.layer_probe import StageProbe, kept_per_run, kept_probe, reduced, runs, whole_probe, with_end
from syntorch.trace.retarget import recost_collectives, retarget
from syntorch.trace.training import COST_MICROBATCHES, layer_kind, probe_optimizer, traced_stage_for

# what a row keeps of a prediction's summary
SUMMARY = ("step_s", "bubble_fraction", "exposed_comm_s", "busy_s", "mfu", "hfu", "mfu_dense_attention")
# plan fields a stage's kept-layer probe does not depend on but through its ranks, copies and part (layer_key)
ACROSS_LAYOUTS = ("pp", "dp", "microbatches", "schedule", "first_stage_layers", "last_stage_layers",
                  "account_for_embedding", "account_for_loss")


def probe_key(config: ModelConfig, plan: TrainPlan, dtype: torch.dtype) -> tuple:
    """What a whole probe is a function of: the plan with its micro-batches capped at COST_MICROBATCHES in
    GPipe's order (plans that differ only in their micro-batch count from there up, or schedule, share it)."""
    probed = dataclasses.replace(plan, microbatches=min(plan.microbatches, COST_MICROBATCHES), schedule="gpipe")
    return repr(config), str(dtype), probed


def share_key(config: ModelConfig, plan: TrainPlan, dtype: torch.dtype) -> tuple:
    """What layouts that share probes agree on: layer_key's but the micro-batch size, the recomputation (which
    share the end of backward and optimizer) and the stage's part."""
    fields = tuple((f.name, getattr(plan, f.name)) for f in dataclasses.fields(plan)
                   if f.init and f.name not in (*ACROSS_LAYOUTS, "micro_batch_size", "recompute"))
    dp = plan.dp if plan.zero >= 2 else plan.dp > 1  # ZeRO-2 and FSDP shards are 1/dp of a bucket or unit
    return repr(config), str(dtype), fields, dp


def layer_key(config: ModelConfig, plan: TrainPlan, stage: int, dtype: torch.dtype) -> tuple:
    """What a stage's kept-layer probe is a function of (module docstring)."""
    full, keep = plan.stage(config, stage), kept_per_run(plan)
    part = tuple((full.holds_input(c), full.holds_loss(c),
                  tuple((layer_kind(config, run[0], plan.moe_load), min(len(run), keep), len(run) > keep)
                        for run in runs(config, chunk, plan.moe_load)))
                 for c, chunk in enumerate(full.chunks or (full.layers,)))
    return (share_key(config, plan, dtype), plan.micro_batch_size, plan.recompute,
            min(plan.microbatches, COST_MICROBATCHES), part)


def optimizer_key(config: ModelConfig, plan: TrainPlan, stage: int, dtype: torch.dtype) -> tuple:
    plain = dataclasses.replace(plan, microbatches=1, micro_batch_size=1, recompute="none", schedule="gpipe")
    return "optimizer", repr(config), str(dtype), plain, stage


class ProbeCache:
    """The probes (and their graphs' durations) of the last `size` layer or whole probe keys and of the last
    `ends` optimizer keys (small graphs, one per stage of each pipeline depth): a search hands each worker the
    layouts of one share_key, those that share kept layers one after another (evaluate_group)."""

    def __init__(self, size: int = 4, ends: int = 32):
        self.layers, self.ends, self.traced = _Recent(size), _Recent(ends), 0

    def probes(self, config: ModelConfig, plan: TrainPlan, dtype: torch.dtype, software: tuple) -> tuple[dict, list]:
        """({traced stage: its StageProbe, durations for software = (hw, profile, attention)}, source)."""
        source = traced_stage_for(config, plan)
        return {s: self._stage(config, plan, s, dtype, software) for s in sorted(set(source))}, source

    def _stage(self, config, plan, stage, dtype, software):
        cut = reduced(config, plan, stage) if plan.ep == 1 else None  # expert groups stay where they were traced
        if cut:
            kept, mesh = self._get(self.layers, layer_key(config, plan, stage, dtype), software, lambda: (
                kept_probe(config, plan, stage, dtype, COST_MICROBATCHES, cut), plan.mesh))
            optimizer = self._get(self.ends, optimizer_key(config, plan, stage, dtype), software,
                                  lambda: StageProbe(*probe_optimizer(config, plan, stage, dtype)))
            # the kept layers (named as where they were traced) standing for this stage's runs
            runs_ = [(c, layers, mine[2]) for (c, layers, _), mine in zip(kept.runs, cut[1])] if kept else []
            probe = kept and with_end(self._moved(kept, mesh, plan.mesh, stage, software), runs_, optimizer,
                                      plan.mesh)
            if probe:
                return probe
        return self._get(self.layers, (*probe_key(config, plan, dtype), stage), software,
                         lambda: whole_probe(config, plan, stage, dtype, COST_MICROBATCHES))

    @staticmethod
    def _moved(kept: StageProbe, mesh, to_mesh, stage: int, software: tuple) -> StageProbe:
        """A kept-layer probe traced on `mesh` as `stage` of `to_mesh` runs it (retarget.py), up to where the
        whole stage's end of backward (or, under FSDP, the optimizer step) takes over."""
        graph, middles = kept[0], kept.middles
        if (mesh, graph.graph["stage"]) != (to_mesh, stage):
            end = kept[1][("optimizer", None, None)][0] if kept.finish is None else kept.finish
            graph = retarget(graph, mesh, to_mesh, stage, end)
            middles = {c: middle and (retarget(middle[0], mesh, to_mesh, stage), middle[1])
                       for c, middle in middles.items()}
            for moved in [graph, *(middle[0] for middle in middles.values() if middle)]:
                recost_collectives(moved, *software)
        return StageProbe(graph, kept[1], finish=kept.finish, middles=middles)

    def _get(self, cache: "_Recent", key: tuple, software: tuple, make):
        """The value of `key` in `cache` (made by `make()` if missing), its graphs' durations for `software`."""
        if key not in cache:
            cache.put(key, [make(), None])
            self.traced += 1
        cache.move_to_end(key)
        entry = cache[key]
        if entry[1] != software:
            probe = entry[0] if isinstance(entry[0], StageProbe) else entry[0][0]  # (kept probe or None, mesh)
            for graph in probe.graphs if probe else ():
                fill_durations(graph, *software)
            entry[1] = software
        return entry[0]


class _Recent(OrderedDict):
    """The last `size` entries put, least recently used first."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def put(self, key, value) -> None:
        self[key] = value
        while len(self) > self.size:
            self.popitem(last=False)


def predict_plan(config: ModelConfig, plan: TrainPlan, hw: HardwareConfig, cache: ProbeCache | None = None,
                 dtype: torch.dtype = torch.bfloat16, profile: str = "fused", attention: str = "flash") -> Prediction:
    """The training step `syntorch trace --predict_only` predicts for `plan` on `hw`, tracing only the probes
    `cache` lacks. The memory check is the caller's (the search prunes by memory before)."""
    probes, source = (cache or ProbeCache()).probes(config, plan, dtype, (hw, profile, attention))
    return predict_training(probes, source, plan, hw, profile, attention)


def evaluate_group(config: ModelConfig, dtype: str, profile: str, attention: str, jobs: list[tuple]) -> list[tuple]:
    """A task of the search: jobs (index, plan, hw) sharing one share_key -> (index, summary figures or None,
    the one-line reason a plan was refused). Runs in a worker process or a Ray task (runner.py)."""
    cache, out = ProbeCache(), []
    # those sharing kept layers one after another (the cache keeps few of them), each machine's in turn
    for index, plan, hw in sorted(jobs, key=lambda job: (job[2].name, job[1].micro_batch_size, job[1].recompute)):
        try:
            summary = predict_plan(config, plan, hw, cache, getattr(torch, dtype), profile, attention).summary
        except UserError as e:
            out.append((index, None, str(e)))
            continue
        out.append((index, {k: summary[k] for k in SUMMARY if k in summary}, None))
    # no collection (a full one, ~0.27 CPU s a 405B task): the tracer hands what it made to the oldest generation
    # unscanned (graph.no_gc), where a cycle holding a probe would wait for a rare full pass, but none does
    # (tests/plan/test_task_frees.py); the cycles a task leaves are torch's pytree closures (~3,000 small objects
    # a 405B task), for the next full pass
    return out
