"""What a simulated run says per rank kind. Every moment of the step is one of three things:
- busy: the compute stream runs a kernel;
- exposed communication: the compute stream runs nothing and some communication is in flight;
- idle: neither (pipeline bubbles, waiting for a late rank or for a sender that has not sent yet).
So step = busy + exposed + idle on every rank kind. A task that stands for a whole simulated step
(steps.py, `Program.inner`) brings its own busy and exposed time and its communication streams' busy
time; its length beyond those is idle. A stream's busy time is the sum of its tasks (never more than the
step: a stream runs one task at a time)."""
from syntorch.simulate.engine import COMPUTE, Run


def kind_stats(run: Run) -> list[dict]:
    step = run.end_us
    out = []
    for p, starts, ends in zip(run.programs, run.starts, run.ends):
        compute, comm, streams = [], [], {COMPUTE: 0.0}
        inner_exposed = 0.0
        for i, stream in enumerate(p.streams):
            length = ends[i] - starts[i]
            inside = p.inner.get(i)
            if inside is not None:
                streams[COMPUTE] += inside[0]
                inner_exposed += inside[1]
                for name, us in inside[2]:
                    streams[name] = streams.get(name, 0.0) + us
            else:
                streams[stream] = streams.get(stream, 0.0) + length
            if stream == COMPUTE:
                compute.append((starts[i], ends[i]))
            elif length > 0:
                comm.append((starts[i], ends[i]))
        comm_union = _union(comm)
        # communication outside the step tasks counts where no compute task runs (inside one, the task's
        # own accounting has it)
        exposed = inner_exposed + _length(comm_union) - _overlap(comm_union, _union(compute, ordered=True))
        busy = streams[COMPUTE]
        out.append({"kind": p.name, "ranks": p.ranks, "busy_us": busy, "exposed_comm_us": exposed,
                    "idle_us": step - busy - exposed, "streams_busy_us": streams})
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
