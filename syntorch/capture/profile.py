"""torch.profiler over a training loop: the host execution trace (ExecutionTraceObserver) and the device
trace (Kineto) of the same profiler steps, plus the stacks text, per rank.

The observer is passed to the profiler (`execution_trace_observer=`), so it starts and stops with the
active window and both traces hold the same `ProfilerStep#N`. The schedule runs one cycle: a second
cycle would write a second trace over the first (the seed's duplicated-JSON host traces).
"""
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ExecutionTraceObserver, ProfilerActivity

from syntorch.errors import UserError


@dataclass(frozen=True)
class TraceFiles:
    """Where one rank's capture goes: `<name>_host.<rank>.json`, `<name>_device.<rank>.json`,
    `<name>_stacks.<rank>.txt`, `<name>_merged.<rank>.json` (linked) and `<name>.<rank>.et`."""
    folder: Path
    name: str
    rank: int

    @property
    def host(self) -> Path:
        return self.folder / f"{self.name}_host.{self.rank}.json"

    @property
    def device(self) -> Path:
        return self.folder / f"{self.name}_device.{self.rank}.json"

    @property
    def stacks(self) -> Path:
        return self.folder / f"{self.name}_stacks.{self.rank}.txt"

    @property
    def merged(self) -> Path:
        return self.folder / f"{self.name}_merged.{self.rank}.json"

    @property
    def et(self) -> Path:
        return self.folder / f"{self.name}.{self.rank}.et"


@dataclass(frozen=True)
class Schedule:
    """Profiler steps (one optimizer step each): skipped, warmed up (profiled, discarded), recorded."""
    wait: int = 1
    warmup: int = 1
    active: int = 1

    def __post_init__(self):
        # without a warmup step torch 2.13's profiler records events whose names it cannot decode when exported
        if self.wait < 0 or self.warmup < 1 or self.active < 1:
            raise UserError(f"the trace schedule needs --trace-wait-steps >= 0, --trace-warmup-steps >= 1 and "
                            f"--trace-active-steps >= 1; got {self.wait}, {self.warmup} and {self.active}")

    @property
    def steps(self) -> int:
        return self.wait + self.warmup + self.active


def quiet_profiler() -> None:
    """Silence the profiler's informational chatter (Kineto's profiler_start/stop and stage lines, the execution
    trace observer's enable/disable warnings: eight lines per traced run), unless the user chose a level.
    Kineto reads its level when a profiler first starts; torch's C++ log level is read when torch is
    imported, so for that one the ranks must get it in their environment before they start."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def make_profiler(files: TraceFiles, schedule: Schedule, device: str, log=None) -> torch.profiler.profile:
    """A profiler to enter around the loop and step once per optimizer step; it writes `files` when the
    active window closes. `log` (flight_recorder.CollectiveLog) is opened and closed with the window."""
    from torch._C._profiler import _ExperimentalConfig

    quiet_profiler()
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    observer = ExecutionTraceObserver().register_callback(str(files.host))
    steps = torch.profiler.schedule(wait=schedule.wait, warmup=schedule.warmup, active=schedule.active, repeat=1)

    def window(step: int):
        # the profiler asks for step n's action as step n begins: the active window opens at wait + warmup
        if log is not None and step == schedule.wait + schedule.warmup and log.first_record is None:
            log.open()
        return steps(step)

    def write_device_trace(prof):
        if log is not None:
            log.close()
        prof.export_chrome_trace(str(files.device))
        prof.export_stacks(str(files.stacks), "self_cuda_time_total" if cuda else "self_cpu_time_total")

    return torch.profiler.profile(
        activities=activities, schedule=window, on_trace_ready=write_device_trace, execution_trace_observer=observer,
        record_shapes=True, with_stack=True,
        experimental_config=_ExperimentalConfig(verbose=True))  # verbose: Python frames in the stacks export
