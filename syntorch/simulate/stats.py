"""What a simulated run says per rank kind: how long its compute stream was busy, how long communication
held it up (exposed: some communication in flight while the compute stream had nothing to run), and how
long it idled otherwise (pipeline bubbles, waiting for a late rank)."""
from syntorch.simulate.engine import COMPUTE, Run


def kind_stats(run: Run) -> list[dict]:
    step = run.end_us
    out = []
    for p, starts, ends in zip(run.programs, run.starts, run.ends):
        compute, comm, streams = [], [], {}
        busy = inner_exposed = 0.0
        for i, stream in enumerate(p.streams):
            length = ends[i] - starts[i]
            streams[stream] = streams.get(stream, 0.0) + length
            if stream == COMPUTE:
                compute.append((starts[i], ends[i]))
                inside = p.inner.get(i)
                busy += inside[0] if inside else length
                inner_exposed += inside[1] if inside else 0.0
            elif length > 0:
                comm.append((starts[i], ends[i]))
        comm_union = _union(comm)
        exposed = inner_exposed + _length(comm_union) - _overlap(comm_union, _union(compute, ordered=True))
        out.append({"kind": p.name, "ranks": p.ranks, "busy_us": busy, "exposed_comm_us": exposed,
                    "idle_us": max(step - busy - exposed, 0.0), "streams_busy_us": streams})
    return out


def _union(intervals: list[tuple[float, float]], ordered: bool = False) -> list[list[float]]:
    """`ordered`: already by start (one stream's tasks, which run in order)."""
    merged = []
    for a, b in intervals if ordered else sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(xs, ys) -> float:
    """Total overlap of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(hi - lo, 0.0)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total
