"""Which process group each collective of a capture used, from torch's flight recorder.

A CPU (gloo) capture does not say: the execution trace writes a c10d op's ProcessGroup argument as
"<Object>", and gloo records no `record_param_comms` event. torch's flight recorder (on when
TORCH_FR_BUFFER_SIZE > 0 as the process group starts; gloo and NCCL) logs every collective as it is issued,
with its group's name, the name the profiler's `pg_config` lists with the group's global ranks. The
collectives of the profiler's active window are the recorder's entries after the window opened, in issue
order; the trace's gloo collectives are the same ops in the same order (repair.py pairs them up).

gloo's point-to-point ops are not in the recorder: capture/peers.py finds their peers.
torch reads the recorder through `torch._C._distributed_c10d._dump_fr_trace_json`; this is the one place
syntorch touches it.
"""
import json
import os

import torch.distributed as dist

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
BUFFER_ENTRIES = "100000"  # collectives kept (a ring): more than a captured step issues


def enable() -> None:
    """Turn the recorder on for process groups started after this, unless the user chose a size."""
    os.environ.setdefault(BUFFER_ENV, BUFFER_ENTRIES)


def _entries() -> list[dict]:
    if not dist.is_initialized():
        return []
    from torch._C._distributed_c10d import _dump_fr_trace_json

    return json.loads(_dump_fr_trace_json(True, False)).get("entries", [])


class CollectiveLog:
    """The collectives issued between `open()` and `close()`: [(profiling name, process group name)], None
    until then."""

    def __init__(self):
        self.first_record = None
        self.collectives: list[tuple[str, str]] | None = None

    def open(self) -> None:
        self.first_record = max((e["record_id"] for e in _entries()), default=-1) + 1

    def close(self) -> None:
        if self.first_record is None:
            return
        self.collectives = [(e["profiling_name"], str(e["process_group"][0])) for e in _entries()
                            if e["record_id"] >= self.first_record and not e.get("is_p2p")]
