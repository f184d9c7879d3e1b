"""Chrome trace event JSON (loads in ui.perfetto.dev and chrome://tracing): one track per rank, one
complete ("X") slice per op and collective, in traced order.

A slice lasts `duration_us` when the graph has it (measured, or from cost.py with a hardware config);
otherwise its length is a stand-in proportional to its work -- FLOPs at ESTIMATE_FLOPS_PER_US, collective
bytes at ESTIMATE_BYTES_PER_US, at least MIN_US -- and the slice says `"estimated": true`.
"""
import json
from collections.abc import Mapping

from syntorch.outdir import atomic_output_file
from syntorch.trace.graph import TraceGraph

ESTIMATE_FLOPS_PER_US = 1e6  # 1 TFLOP/s: only the relative lengths of estimated slices mean anything
ESTIMATE_BYTES_PER_US = 1e4  # 10 GB/s
MIN_US = 0.01


def _duration(d: dict) -> tuple[float, bool]:
    if d.get("duration_us") is not None:
        return float(d["duration_us"]), False
    work = d["bytes"] / ESTIMATE_BYTES_PER_US if d["kind"] == "collective" else d["flops"] / ESTIMATE_FLOPS_PER_US
    return max(work, MIN_US), True


def _args(d: dict, estimated: bool) -> dict:
    keep = ("module", "phase", "flops", "bytes_read", "bytes_written", "collective", "reduce_op", "group",
            "bytes", "src", "dst", "tag", "order", "num_ops")
    return {**{k: d[k] for k in keep if d.get(k) is not None}, "estimated": estimated}


def rank_events(graph: TraceGraph, rank: int) -> list[dict]:
    events = track_names(rank, f"rank {rank}", {})
    now = 0.0
    for _, d in graph.work():
        dur, estimated = _duration(d)
        events.append({"ph": "X", "name": d["name"], "cat": d["kind"], "pid": rank, "tid": 0, "ts": now,
                       "dur": dur, "args": _args(d, estimated)})
        now += dur
    return events


def trace_events(graphs) -> dict:
    """`graphs`: one TraceGraph or a rank -> TraceGraph mapping (RankTraces)."""
    by_rank = graphs if isinstance(graphs, Mapping) else {graphs.graph.get("rank", 0): graphs}
    events = [e for rank in sorted(by_rank) for e in rank_events(by_rank[rank], rank)]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


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


def export(graphs, path, level: str | None = None) -> None:
    from syntorch.trace.levels import level_view
    if level and not isinstance(graphs, Mapping):
        graphs = level_view(graphs, level)
    elif level:
        graphs = {r: level_view(g, level) for r, g in graphs.items()}
    write_events(trace_events(graphs)["traceEvents"], path)
