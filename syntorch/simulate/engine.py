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
    """One rank kind's tasks in program order. `inner[i]` (optional), of a compute task that stands for a
    whole simulated step (steps.py): (compute µs, exposed comm µs, ((stream, µs busy), ...) of the
    communication inside it), for the statistics (stats.py)."""
    name: str
    ranks: int = 1
    names: list[str] = field(default_factory=list)
    streams: list[str] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    deps: list = field(default_factory=list)  # per task, the tasks it waits for (any sequence)
    syncs: dict[int, Sync] = field(default_factory=dict)
    inner: dict[int, tuple[float, float, tuple]] = field(default_factory=dict)

    def add(self, name: str, stream: str, duration: float, deps=(), sync: Sync | None = None,
            inner: tuple[float, float, tuple] | None = None) -> int:
        i = len(self.names)
        self.names.append(name)
        self.streams.append(stream)
        self.durations.append(duration)
        self.deps.append(deps)
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
    # one flat index over every program's tasks (program k's task i is offsets[k] + i): the loop below runs
    # once per task, so it reads plain lists
    offsets = [0]
    for p in programs:
        offsets.append(offsets[-1] + len(p))
    total = offsets[-1]
    before, durations, syncs = [], [], {}
    for k, p in enumerate(programs):
        base, last = offsets[k], {}
        for i, (stream, deps) in enumerate(zip(p.streams, p.deps)):
            mine = [d + base for d in deps]
            prev = last.get(stream)
            if prev is not None and prev not in mine:
                mine.append(prev)
            last[stream] = base + i
            before.append(mine)
        durations += p.durations
        syncs.update((base + i, sync) for i, sync in p.syncs.items() if sync.mode != "coll" or sync.members > 1)
    users = [[] for _ in range(total)]
    count = [len(b) for b in before]
    for g, b in enumerate(before):
        for d in b:
            users[d].append(g)
    stack = [g for g in range(total) if not count[g]]
    starts, ends = [0.0] * total, [0.0] * total
    meetings, sends, recvs = {}, {}, {}
    done = 0

    def finish(g, start, end):
        nonlocal done
        starts[g], ends[g] = start, end
        done += 1
        for j in users[g]:
            count[j] -= 1
            if not count[j]:
                stack.append(j)

    pop, push = stack.pop, stack.append
    while stack:
        g = pop()
        ready = 0.0
        for d in before[g]:
            if ends[d] > ready:
                ready = ends[d]
        sync = syncs.get(g)
        if sync is None:  # the common case, inlined
            starts[g], ends[g] = ready, ready + durations[g]
            done += 1
            for j in users[g]:
                count[j] -= 1
                if not count[j]:
                    push(j)
        elif sync.mode == "coll":
            arrived = meetings.setdefault(sync.key, [])
            arrived.append((g, ready))
            if len(arrived) == sync.members:
                del meetings[sync.key]
                start = max(r for _, r in arrived)
                length = max(durations[a] for a, _ in arrived)
                for a, _ in arrived:
                    finish(a, start, start + length)
        elif sync.mode == "send":
            sends[sync.key] = (ready, durations[g])
            finish(g, ready, ready + durations[g])
            if sync.key in recvs:
                waiting, at = recvs.pop(sync.key)
                finish(waiting, max(at, ready), max(at, ready + durations[g]))
        elif sync.key in sends:
            sent, length = sends[sync.key]
            finish(g, max(ready, sent), max(ready, sent + length))
        else:
            recvs[sync.key] = (g, ready)
    if done < total:
        raise UserError(f"the simulated ranks deadlock: {_stuck(programs, offsets, count, meetings, recvs)}")
    return Run(programs, [starts[a:b] for a, b in zip(offsets, offsets[1:])],
               [ends[a:b] for a, b in zip(offsets, offsets[1:])])


def _task(programs, offsets, g) -> str:
    k = next(k for k in range(len(programs)) if offsets[k] <= g < offsets[k + 1])
    return f"{programs[k].name}: {programs[k].names[g - offsets[k]]}"


def _stuck(programs, offsets, count, meetings, recvs) -> str:
    waiting = [f"{_task(programs, offsets, arrived[0][0])} (collective {key} has {len(arrived)} of its members)"
               for key, arrived in meetings.items()]
    waiting += [f"{_task(programs, offsets, g)} (recv {key} has no send)" for key, (g, _) in recvs.items()]
    if not waiting:
        waiting = [f"{_task(programs, offsets, count.index(max(count)))} (a dependency cycle)"]
    return "; ".join(waiting[:3]) + (f" and {len(waiting) - 3} more" if len(waiting) > 3 else "")
