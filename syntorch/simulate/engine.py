"""The discrete-event core: programs of tasks on in-order streams, synchronised across programs.

A `Program` is the work of one rank kind (every rank that runs the same graph), in program order. Each
task runs on one stream of its rank (one compute stream; a stream per communicator, as ProcessGroupNCCL
keeps one per process group; one for point-to-point); a stream runs its tasks in program order, one at a
time, and a task starts once the tasks it depends on have ended. What ties programs together:

- a collective with `Sync("coll", key, members)` starts when all `members` programs have reached their task
  of that key, and ends for all of them together (its duration later). A collective among ranks of one
  kind has one member: they run the same program on the same clock, so nobody waits.
- a send is eager (as Megatron's batched isend): it occupies its own stream for its duration from when it
  is ready and never waits for the receiver; the recv of the same key ends when its data has arrived
  (send start + duration) or when it is ready, whichever is later.

Times follow from dependencies alone (a stream's order is fixed), so tasks are resolved in dependency order
(Kahn's algorithm over all programs at once) with no event queue; a cycle or an unmatched collective or
recv is reported as a deadlock naming the stuck tasks.
"""
from dataclasses import dataclass, field
from typing import NamedTuple

from syntorch.errors import UserError

COMPUTE = "compute"
P2P = "p2p"


class Sync(NamedTuple):
    mode: str  # "coll", "send" or "recv"
    key: tuple  # equal for the tasks that meet
    members: int = 1  # programs that meet at a collective


@dataclass
class Program:
    """One rank kind's tasks in program order. `inner[i]` (optional): (compute µs, exposed comm µs) of a task
    that stands for a whole simulated step, for the busy/exposed accounting."""
    name: str
    ranks: int = 1
    names: list[str] = field(default_factory=list)
    streams: list[str] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    deps: list[list[int]] = field(default_factory=list)
    syncs: dict[int, Sync] = field(default_factory=dict)
    inner: dict[int, tuple[float, float]] = field(default_factory=dict)

    def add(self, name: str, stream: str, duration: float, deps=(), sync: Sync | None = None,
            inner: tuple[float, float] | None = None) -> int:
        i = len(self.names)
        self.names.append(name)
        self.streams.append(stream)
        self.durations.append(float(duration))
        self.deps.append(list(deps))
        if sync is not None:
            self.syncs[i] = sync
        if inner is not None:
            self.inner[i] = inner
        return i

    def __len__(self) -> int:
        return len(self.names)


@dataclass
class Run:
    """Start and end (µs) of every task of every program."""
    programs: list[Program]
    starts: list[list[float]]
    ends: list[list[float]]

    @property
    def end_us(self) -> float:
        return max((max(e, default=0.0) for e in self.ends), default=0.0)


def simulate(programs: list[Program]) -> Run:
    starts = [[0.0] * len(p) for p in programs]
    ends = [[0.0] * len(p) for p in programs]
    pending, users, prevs, stack = [], [], [], []
    for k, p in enumerate(programs):
        after = [[] for _ in range(len(p))]
        count, prev = [0] * len(p), [None] * len(p)
        last = {}
        for i, (stream, deps) in enumerate(zip(p.streams, p.deps)):
            before = set(deps)
            prev[i] = last.get(stream)
            if prev[i] is not None:
                before.add(prev[i])
            last[stream] = i
            for d in before:
                after[d].append(i)
            count[i] = len(before)
            if not before:
                stack.append((k, i))
        pending.append(count)
        users.append(after)
        prevs.append(prev)
    meetings, sends, recvs = {}, {}, {}
    done = 0

    def finish(k, i, start, end):
        nonlocal done
        starts[k][i], ends[k][i] = start, end
        done += 1
        count = pending[k]
        for j in users[k][i]:
            count[j] -= 1
            if not count[j]:
                stack.append((k, j))

    while stack:
        k, i = stack.pop()
        p = programs[k]
        ready = max((ends[k][d] for d in p.deps[i]), default=0.0)
        prev = prevs[k][i]
        if prev is not None and ends[k][prev] > ready:
            ready = ends[k][prev]
        sync = p.syncs.get(i)
        if sync is None or (sync.mode == "coll" and sync.members == 1):
            finish(k, i, ready, ready + p.durations[i])
        elif sync.mode == "coll":
            arrived = meetings.setdefault(sync.key, [])
            arrived.append((k, i, ready))
            if len(arrived) == sync.members:
                start = max(r for _, _, r in arrived)
                length = max(programs[a].durations[b] for a, b, _ in arrived)
                del meetings[sync.key]
                for a, b, _ in arrived:
                    finish(a, b, start, start + length)
        elif sync.mode == "send":
            sends[sync.key] = (ready, p.durations[i])
            finish(k, i, ready, ready + p.durations[i])
            if sync.key in recvs:
                _deliver(finish, *recvs.pop(sync.key), ready, p.durations[i])
        else:
            if sync.key in sends:
                _deliver(finish, k, i, ready, *sends[sync.key])
            else:
                recvs[sync.key] = (k, i, ready)
    if done < sum(len(p) for p in programs):
        raise UserError(f"the simulated ranks deadlock: {_stuck(programs, pending, meetings, recvs)}")
    return Run(programs, starts, ends)


def _deliver(finish, k, i, ready, sent, duration):
    finish(k, i, max(ready, sent), max(ready, sent + duration))


def _stuck(programs, pending, meetings, recvs) -> str:
    waiting = [f"{programs[k].name}: {programs[k].names[i]} (collective {key} has {len(arrived)} of "
               f"{programs[k].syncs[i].members} members)" for key, arrived in meetings.items() for k, i, _ in arrived[:1]]
    waiting += [f"{programs[k].name}: {programs[k].names[i]} (recv {key} has no send)" for key, (k, i, _) in recvs.items()]
    if not waiting:
        waiting = [f"{p.name}: {p.names[count.index(max(count))]} (a dependency cycle)"
                   for p, count in zip(programs, pending) if any(count)]
    return "; ".join(waiting[:3]) + (f" and {len(waiting) - 3} more" if len(waiting) > 3 else "")
