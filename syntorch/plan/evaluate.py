"""One layout's predicted step from cached probes: `predict_plan(config, plan, hw, cache)`.

A prediction is the probes of the plan's traced stages (trace/training.py's probe_stage, through
workload.trace_workload with schedule=False), their durations on a machine (trace/cost.fill_durations), and
the step-level simulation (simulate/prediction.predict_training). The probes are a function of what
probe_stage runs: the model, the dtype, and the plan with its micro-batches capped at COST_MICROBATCHES in
GPipe's order; everything else in the plan enters them, the DP degree included (ZeRO's shard sizes, the
DDP buckets' all-reduce group, the groups' ranks). So `probe_key` is that plan itself, and plans that differ
only in their micro-batch count (from COST_MICROBATCHES up) or schedule share probes. Durations are filled
per machine on the shared graphs (fill_durations sets every op's and collective's), so one probe serves every
--compare_hw machine; only fill_durations and the simulator run again.
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
from syntorch.trace.training import COST_MICROBATCHES
from syntorch.workload import trace_workload

# what a row keeps of a prediction's summary
SUMMARY = ("step_s", "bubble_fraction", "exposed_comm_s", "busy_s", "mfu", "hfu", "mfu_dense_attention")


def probe_key(config: ModelConfig, plan: TrainPlan, dtype: torch.dtype) -> tuple:
    """What a plan's probes are a function of (module docstring)."""
    probed = dataclasses.replace(plan, microbatches=min(plan.microbatches, COST_MICROBATCHES), schedule="gpipe")
    return repr(config), str(dtype), probed


@dataclasses.dataclass
class Probes:
    probes: dict  # traced stage -> its StageProbe (trace/layer_probe.py)
    source: list[int]  # stage -> the traced stage it copies
    filled: tuple | None = None  # (hw, profile, attention) of the durations in the graphs

    def fill(self, hw: HardwareConfig, profile: str, attention: str) -> None:
        if self.filled != (hw, profile, attention):
            for probe in self.probes.values():  # a layer probe's optimizer step is a graph of its own
                for graph, _ in (probe, probe.optimizer) if probe.optimizer else (probe,):
                    fill_durations(graph, hw, profile, attention)
            self.filled = (hw, profile, attention)


class ProbeCache:
    """The probes of the last `size` probe keys (a search hands each worker one key's layouts at a time)."""

    def __init__(self, size: int = 2):
        self.size, self.entries, self.traced = size, OrderedDict(), 0

    def get(self, config: ModelConfig, plan: TrainPlan, dtype: torch.dtype) -> Probes:
        key = probe_key(config, plan, dtype)
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        workload = trace_workload(config, plan, dtype, hw=None, schedule=False)
        self.traced += 1
        self.entries[key] = Probes(workload.probes, workload.source)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return self.entries[key]


def predict_plan(config: ModelConfig, plan: TrainPlan, hw: HardwareConfig, cache: ProbeCache | None = None,
                 dtype: torch.dtype = torch.bfloat16, profile: str = "fused", attention: str = "flash") -> Prediction:
    """The training step `syntorch trace --predict_only` predicts for `plan` on `hw`, tracing only the probes
    `cache` lacks. The memory check is the caller's (the search prunes by memory before)."""
    probes = (cache or ProbeCache()).get(config, plan, dtype)
    probes.fill(hw, profile, attention)
    return predict_training(probes.probes, probes.source, plan, hw, profile, attention)


def evaluate_group(config: ModelConfig, dtype: str, profile: str, attention: str, jobs: list[tuple]) -> list[tuple]:
    """A task of the search: jobs (index, plan, hw) sharing one probe key -> (index, summary figures or None,
    the one-line reason a plan was refused). Runs in a worker process or a Ray task (runner.py)."""
    cache, out = ProbeCache(), []
    for index, plan, hw in jobs:
        try:
            summary = predict_plan(config, plan, hw, cache, getattr(torch, dtype), profile, attention).summary
        except UserError as e:
            out.append((index, None, str(e)))
            continue
        out.append((index, {k: summary[k] for k in SUMMARY if k in summary}, None))
    return out
