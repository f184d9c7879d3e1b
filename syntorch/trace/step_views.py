"""A stage's scheduled step at the module or layer level, made from views of its probe's steps.

`scheduled_view` is level_view(schedule_stage(...)) without the scheduled op graph (StageGraphs.kind_view):
each step of the schedule is a copy of a probed step, and so is its part of the view -- its runs
(levels._runs), what they read and what they keep -- but for the schedule's own dependencies
(add_schedule_deps): a step's first nodes read a 0-byte tensor the step before writes, so they read a
collective's output when that step ends with one, and a step's last node feeds a collective when the next
step starts with one. So each probed step is viewed once per such context it is copied into (a 175B stage
of 8 micro-batches: 17 steps, at most 17 views of the probe's 9 steps), and each copy's part of the view is
that view with its nodes placed: the copy's tensors (names, versions) and collectives (tags) as schedule_stage
copies them (_Step.copy, without edges), its inputs from other steps where schedule_stage points them, and
the probe's tensors first read there. Which tensors of a copy later steps read, and whether a collective
reads them, is what the probe's steps read of its probed step; where not (or where a run could go on into
the next step), None: then the op graph is made and viewed.
"""
import bisect

from syntorch.trace.graph import TraceGraph
from syntorch.trace.levels import add_boundary, copy_tensor, cut_runs, feeding, launches_nothing, layer_of, run_attrs
from syntorch.trace.step_schedule import Copies, schedule_attrs

IN, OUT = "in", "out"  # an input of a run: a node of its step (an offset), a probe node outside it
SCHEDULE = "schedule"  # the schedule's tensor, as an input or output of a run


class StepViews:
    """A probe's steps viewed at `level`, by probed step and context, for schedule_stage's copies with
    `by_source` (its `stage` another stage): kept across the stages made from one probe."""

    def __init__(self, probe: TraceGraph, level: str, by_source: bool):
        self.probe, self.level, self.by_source = probe, level, by_source
        self.key = (lambda d: d["module"]) if level == "module" else (lambda d: layer_of(d["module"]))
        attrs, succ = probe.node_attrs, probe.succs
        collectives = [n for n, d in attrs.items() if d["kind"] == "collective"]
        self.reads = {r for c in collectives for t in succ[c] for r in succ[t]}
        self.feeds = feeding(probe, collectives)
        self.views, self.read = {}, {}  # (probed step, context) -> its runs; probed step -> what others read of it
        self.ends, self.outside = {}, {}  # probed step -> its first and last op or collective, and first nodes;
        # -> its inputs from other steps (probe nodes), each with its reader's class (_reader)

    def view(self, key, a: int, b: int, step, context: tuple) -> list[tuple]:
        """The runs of probed step `key` (nodes a to b, its _Step `step`) in `context`, each as (inputs, its
        node's attributes (ops) or offset (a collective's, whose tag moves), outputs: offsets or SCHEDULE)."""
        if (key, context) not in self.views:
            self.views[key, context] = self._view(a, b, step, context)
        return self.views[key, context]

    def _view(self, a, b, step, context) -> list[tuple]:
        token_in, collective_before, token_out, collective_after = context
        probe, attrs, pred, succ = self.probe, self.probe.node_attrs, self.probe.preds, self.probe.succs
        roots = {a + off for off in step.roots} if token_in else set()
        work = [(n, attrs[n]) for n in range(a, b) if attrs[n]["kind"] != "tensor"]
        last = work[-1][0] if work else None
        feeds = self.feeds
        if collective_after:  # the schedule's tensor: the next step's first nodes read the last one's output
            feeds = feeds | {last} | (feeding(probe, [last]) if launches_nothing(attrs[last]) else set())
        runs = []
        for members in cut_runs(work, self.key, self.reads | roots if collective_before else self.reads, feeds):
            first, end = members[0], members[-1]
            inputs, outputs = {}, []  # (inputs: an ordered set) as levels._collapse finds them
            for node in members:  # (a copy's inputs come in the order of their ids)
                add_boundary(attrs, pred, succ, node, first, end, inputs, outputs, by_id=self.by_source)
                if node in roots:
                    inputs[SCHEDULE] = None  # (add_schedule_deps: after the node's other inputs)
                if token_out and node == last:
                    outputs.append(SCHEDULE)
            node = members[0] - a if attrs[members[0]]["kind"] == "collective" else \
                run_attrs(attrs, members, self.level, {})
            runs.append(([(SCHEDULE, None) if t == SCHEDULE else (IN, t - a) if a <= t < b else (OUT, t)
                          for t in inputs], node, [t if t == SCHEDULE else t - a for t in outputs]))
        return runs

    def step_ends(self, key, a: int, b: int, step) -> tuple:
        """Probed step `key`'s first and last op or collective (None without any) and first nodes (_roots)."""
        if key not in self.ends:
            attrs = self.probe.node_attrs
            work = [n for n in range(a, b) if attrs[n]["kind"] != "tensor"]
            self.ends[key] = (work[0], work[-1]) if work else (None, None), [a + off for off in step.roots]
        return self.ends[key]

    def read_in(self, key, step) -> list[tuple]:
        """(probe node, (reader's class, whether a collective made it)) of what probed step `key` reads from
        outside it."""
        if key not in self.outside:
            self.outside[key] = list({(u, (_reader(step.nodes[v]), self._by_collective(u))): None
                                      for u, inside, v, _ in step.edges if not inside})  # (an ordered set)
        return self.outside[key]

    def read_outside(self, key, a: int, b: int) -> set:
        """(offset, (reader's class, whether a collective made it)) of probed step `key`'s tensors that other
        steps read."""
        if key not in self.read:
            attrs, succ = self.probe.node_attrs, self.probe.succs
            self.read[key] = {(t - a, (_reader(attrs[r]), self._by_collective(t)))
                              for t in range(a, b) if attrs[t]["kind"] == "tensor" for r in succ[t] if not a <= r < b}
        return self.read[key]

    def _by_collective(self, t: int) -> bool:
        return any(self.probe.node_attrs[p]["kind"] == "collective" for p in self.probe.preds[t])


def _reader(d: dict) -> int:
    """What a reader is to the runs of what it reads (levels._runs): a collective, an op that launches nothing
    (that may feed one), or another op."""
    return 0 if d["kind"] == "collective" else 1 if launches_nothing(d) else 2


def scheduled_view(views: StepViews, blocks: dict, plan, stage: int | None = None,
                   steps: dict | None = None) -> tuple[TraceGraph, list[dict]] | None:
    """level_view(schedule_stage(probe, blocks, plan, stage=stage, steps=steps), views.level) and the attributes of
    that graph's nodes in order (what stage_figures sums), without making it; None where it may differ."""
    probe, level = views.probe, views.level
    copies = Copies(probe, blocks, plan, stage, steps)
    keys = [copies.source(*step) for step in copies.order]
    contexts = _contexts(views, copies, keys)
    if contexts is None:
        return None
    nodes = [probe.node_attrs[n] for n in range(copies.prefix)]  # the scheduled graph's, as placed
    out, edges, orders, new_tensor = [], [], {}, {}  # new_tensor: scheduled node -> view node, as levels'
    read, bases = [], []  # (scheduled node, read_in's classes) read from another step; each copy's first node
    for k, (step, base, shift, image) in enumerate(copies.placed_in(nodes)):
        nodes += step.copy(base, shift * plan.virtual_stages, image, nodes, copies.latest)
        bases.append(base)
        read += [(image(u), classes) for u, classes in views.read_in(keys[k], step)]
        for inputs, node, outputs in views.view(keys[k], *copies.blocks[keys[k]], step, contexts[k]):
            ids = []
            for where, t in inputs:
                t = (SCHEDULE, k) if where == SCHEDULE else base + t if where == IN else image(t)
                if t not in new_tensor:  # (the schedule's tensor is made as the step before's output)
                    new_tensor[t] = copy_tensor(out, nodes[t])
                ids.append(new_tensor[t])
            n = len(out)
            out.append(run_attrs(nodes, [base + node], level, orders) if isinstance(node, int) else dict(node))
            edges += [(t, n, {"arg": arg}) for arg, t in enumerate(ids)]
            for arg, t in enumerate(outputs):
                t, data = ((SCHEDULE, k + 1), _token(k + 1)) if t == SCHEDULE else (base + t, nodes[base + t])
                new_tensor[t] = copy_tensor(out, data)
                edges.append((n, new_tensor[t], {"arg": arg}))
    if not _read_as_probed(views, copies, keys, bases, read):
        return None
    view = TraceGraph(**{**probe.graph, **schedule_attrs(plan, copies.order), "level": level})
    view.append(out, edges, copy=False)
    return view, nodes


def _token(k: int) -> dict:
    """The attributes of add_schedule_deps's tensor read by step k (add_tensor's)."""
    return {"kind": "tensor", "name": f"schedule[{k}]", "shape": [], "dtype": "none", "bytes": 0,
            "is_param": False, "device": "meta", "version": 0}


def _contexts(views, copies, keys) -> list[tuple] | None:
    """Each step's context (StepViews.view): whether the schedule's tensor comes in (add_schedule_deps: the
    step before has an op or collective, this one a first node) and from a collective, and whether it goes
    out and to a collective. None where the last run of a step could go on into the next (same key and phase)."""
    attrs, key = views.probe.node_attrs, views.key
    ends = [views.step_ends(k, *copies.blocks[k], copies.step(k)) for k in keys]
    tokens = [k > 0 and ends[k - 1][0][1] is not None and bool(ends[k][1]) for k in range(len(keys))] + [False]
    contexts = []
    for k, ((first, last), roots) in enumerate(ends):
        if k and ends[k - 1][0][1] is not None and first is not None:
            before, here = attrs[ends[k - 1][0][1]], attrs[first]
            if before["kind"] == here["kind"] == "op" and (key(before), before["phase"]) == (key(here), here["phase"]):
                return None
        after = tokens[k + 1] and any(attrs[r]["kind"] == "collective" for r in ends[k + 1][1])
        contexts.append((tokens[k], tokens[k] and attrs[ends[k - 1][0][1]]["kind"] == "collective", tokens[k + 1],
                         after))
    return contexts


def _read_as_probed(views, copies, keys, bases, read) -> bool:
    """Do later steps read of each copy what the probe's other steps read of its probed step (the outputs its
    view keeps), alike (what feeds a collective, what a collective made: what cuts runs)?"""
    found = [set() for _ in keys]
    for t, classes in read:
        k = bisect.bisect_right(bases, t) - 1
        if k >= 0:  # (not the probe's nodes before its steps)
            found[k].add((t - bases[k], classes))
    return all(found[k] == views.read_outside(key, *copies.blocks[key]) for k, key in enumerate(keys))
