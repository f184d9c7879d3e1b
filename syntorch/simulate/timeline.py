"""A simulated run as Chrome trace event JSON (ui.perfetto.dev, chrome://tracing): one process per rank
kind, one track per stream (compute first, then each communicator's), one complete ("X") slice per task."""
import json

from syntorch.outdir import atomic_output_file
from syntorch.simulate.engine import COMPUTE, Run


def timeline_events(run: Run, args: list[list[dict]] | None = None) -> list[dict]:
    """`args[k][i]` (optional): what slice i of program k shows when selected."""
    events = []
    for pid, (p, starts, ends) in enumerate(zip(run.programs, run.starts, run.ends)):
        tids = {s: t for t, s in enumerate(dict.fromkeys([COMPUTE, *p.streams]))}
        events += track_names(pid, f"{p.name} ({p.ranks} rank{'s' * (p.ranks > 1)})", {t: s for s, t in tids.items()})
        slices = [{"ph": "X", "name": name, "pid": pid, "tid": tids[stream], "ts": a, "dur": b - a}
                  for name, stream, a, b in zip(p.names, p.streams, starts, ends)]
        if args is not None:
            for event, extra in zip(slices, args[pid], strict=True):
                event["args"] = extra
        events += slices
    return events


def track_names(pid: int, process: str, threads: dict[int, str]) -> list[dict]:
    """Metadata events naming a process (sorted by pid) and its threads (tracks)."""
    events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}},
              {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
    return events + [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
                     for tid, name in threads.items()]


def write_events(events: list[dict], path) -> None:
    """The events as one Chrome trace JSON file at `path`, whole or not at all."""
    with atomic_output_file(path) as tmp:
        tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, separators=(",", ":")))
