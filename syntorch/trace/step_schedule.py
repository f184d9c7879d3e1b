"""A stage's step in its own schedule, assembled from the steps a probe traced (training.py's probe_stage).

Micro-batches repeat: each step of the schedule (a forward or backward of a micro-batch, of a chunk when
interleaved) is a copy of the probed step that plays its part (`probed_microbatch`: the same micro-batch when
probed, else the first backward, a middle one or the last), its inputs from other steps re-pointed at the
steps that play the same part there (`schedule_stage`; tested equal to running every micro-batch).

The schedule is part of the trace: a stage runs its steps one after another, so the ops of a step that depend
on nothing inside it get a dependency on the last node of the step before, through a 0-byte `schedule` tensor
(kept by every level and exporter, a data dep in Chakra).
"""
import bisect

from syntorch.parallel import plans
from syntorch.parallel.pipeline import schedule
from syntorch.trace.graph import TraceGraph


def probed_microbatch(kind: str, m: int, microbatches: int, probed: int) -> int:
    """The probed step a step is copied from: the same micro-batch when probed; else the first backward
    (fresh gradients), the last one (gradient sync), or a middle one (accumulation after accumulation)."""
    if m < probed - 1 or microbatches == probed:
        return m
    return probed - 1 if kind == "F" or m == microbatches - 1 else probed - 2


def schedule_stage(probe: TraceGraph, blocks: dict, plan: plans.TrainPlan, keep: bool = False,
                   stage: int | None = None, steps: dict | None = None, share: bool = False) -> TraceGraph:
    """The stage's step in its own schedule with `plan.microbatches` micro-batches, from a probe's steps:
    each step is a copy of a probed step whose inputs from other steps are re-pointed at the steps that
    play the same part (the same micro-batch's forward, the previous backward). `stage`: another stage's
    schedule, for a shifted copy of the probe's stage; then each node's inputs are in the order a copy
    shift_stage made has them, by their producers' ids (StageGraphs.kind_view). `steps`: the probe's steps
    as prepared for copying, kept across calls on one probe and stage (a dict, filled here); `share`: nodes
    and edges that are the probe's as they are keep its attribute dicts, not copies (for a graph that is read
    and dropped: no second copy of them alive).

    When the stage runs just the probed steps in the probed order (e.g. one micro-batch) the copy would be
    the probe itself: then `probe` is finished in place and returned (`keep`: a copy of it)."""
    copies = Copies(probe, blocks, plan, stage, steps)
    order, found = copies.order, copies.found
    if copies.as_probed():
        finished = copy_graph(probe, copies.by_source) if keep or copies.by_source else probe
        _renumber_orders(finished)
        return set_schedule(finished, plan, order, [start for start, _, _ in found])
    prefix = copies.prefix
    out = TraceGraph(**probe.graph)
    out.append((probe.node_attrs[n] for n in range(prefix)),
               ((u, v, e) for u in range(prefix) for v, e in probe.succs[u].items() if v < prefix), copy=not share)
    collectives = [n for n, d in out.node_attrs.items() if d["kind"] == "collective"]  # and the steps', as placed
    for step, base, shift, image in copies.placed_in(out):
        out.append(step.copy(base, shift * plan.virtual_stages, image, out.node_attrs, copies.latest),
                   [(base + u if inside else image(u), base + v, e) for u, inside, v, e in step.edges],
                   copy=not share)  # (a list, not a generator: ~30% faster for 10^4 edges a step)
        collectives += [base + off for off in step.collectives]
    _renumber_orders(out, collectives)
    return set_schedule(out, plan, order, copies.starts(), copies.roots())


class Copies:
    """The steps of a stage's schedule as copies of a probe's steps (schedule_stage's; step_views.py's): which
    probed step each copies, where it is placed and where its inputs from other steps are. `stage`, `steps`:
    schedule_stage's."""

    def __init__(self, probe: TraceGraph, blocks: dict, plan: plans.TrainPlan, stage: int | None = None,
                 steps: dict | None = None):
        self.probe, self.blocks, self.plan = probe, blocks, plan
        self.by_source = stage is not None and stage != probe.graph["stage"]
        stage = probe.graph["stage"] if stage is None else stage
        self.probed = 1 + max(m for kind, m, _ in blocks if kind != "optimizer")
        self.order = [*stage_steps(plan, stage),
                      *([("optimizer", plan.microbatches, None)] if ("optimizer", None, None) in blocks else [])]
        self.found = sorted((start, end, key) for key, (start, end) in blocks.items())
        self.prefix = self.found[0][0]
        self.steps = {} if steps is None else steps  # probed step -> _Step
        # each parameter's or buffer's latest (node, version) as placed: state a step reads from another step
        # is whatever was last written to it in this schedule (FSDP writes parameters every micro-batch)
        nodes = probe.node_attrs
        self.latest = {nodes[n]["name"]: (n, nodes[n]["version"]) for n in range(self.prefix) if _state(n, nodes[n])}
        self.placed = {}  # (kind, microbatch, chunk) -> its first node as placed
        self.where = {}  # probe node -> (its name if state, else None; its step's (start, end, key)), found once

    def source(self, kind, m, c) -> tuple:
        """The probed step a step is copied from (the optimizer's one step for itself)."""
        if kind == "optimizer":
            return "optimizer", None, None
        return kind, probed_microbatch(kind, m, self.plan.microbatches, self.probed), c

    def as_probed(self) -> bool:
        """Does the stage run just the probed steps in the probed order?"""
        return [key for _, _, key in self.found] == \
            [self.source(*step) if step[0] == "optimizer" else step for step in self.order]

    def step(self, key) -> "_Step":
        if key not in self.steps:  # each probed step prepared once, however many copies it makes
            self.steps[key] = _Step(self.probe, *self.blocks[key], self.by_source)
        return self.steps[key]

    def placed_in(self, out):
        """Each step in order as (its probed step's _Step, its first node: len(out) when it comes, its shift in
        micro-batches, image: what a probe node it reads from outside it is as placed); the caller places it."""
        for kind, m, c in self.order:
            key = self.source(kind, m, c)
            step = self.step(key)
            base = self.placed[(kind, m, c)] = len(out)
            shift = m - (self.probed if kind == "optimizer" else key[1])
            yield step, base, shift, lambda u, shift=shift: self.image(u, shift)
            self.latest.update(step.written)

    def image(self, u: int, shift: int) -> int:
        """Probe node u (before or in another step) as read by a copy made `shift` micro-batches later:
        the same node of the step placed that plays u's step's part."""
        if u < self.prefix:
            return u
        if u not in self.where:
            d = self.probe.node_attrs[u]
            self.where[u] = (d["name"] if _state(u, d) else None), \
                self.found[bisect.bisect_right(self.found, (u, float("inf"))) - 1]
        state, (start, end, (kind, k, c)) = self.where[u]
        if state:
            return self.latest[state][0]
        a, b = self.blocks[self.source(kind, k + shift, c)]
        assert b - a == end - start, f"probed steps {self.source(kind, k + shift, c)} and {(kind, k, c)} differ"
        return self.placed[(kind, k + shift, c)] + u - start

    def starts(self) -> list[int]:
        return [self.placed[step] for step in self.order]

    def roots(self) -> list[list[int]]:
        """Each placed step's first nodes (_roots): those of the step it copies, moved."""
        return [[self.placed[step] + off for off in self.steps[self.source(*step)].roots] for step in self.order]


def stage_steps(plan: plans.TrainPlan, stage: int) -> list[tuple[str, int, int]]:
    """The steps a stage runs, in its schedule's order (pipeline.schedule; forwards only in inference)."""
    if plan.mode != "train":
        return [("F", m, 0) for m in range(plan.microbatches)]
    return schedule(plan.schedule, stage, plan.pp, plan.microbatches, plan.virtual_stages)


class _Step:
    """A probed step prepared for copying: its nodes' attributes, which of them move with the micro-batch,
    and its in-edges in their order (from inside the step as offsets, else as probe nodes); `by_source`: each
    node's inputs by their producers' ids (schedule_stage's)."""

    def __init__(self, probe: TraceGraph, a: int, b: int, by_source: bool = False):
        nodes, preds = probe.node_attrs, probe.preds
        self.a, self.nodes, self.moving, self.edges = a, [nodes[n] for n in range(a, b)], {}, []
        self.state, self.collectives = [], []  # offsets of parameters and buffers, and of collectives
        edges = self.edges
        for n, data in enumerate(self.nodes, a):  # one pass: a stage's probed steps are 10^4 nodes
            inputs = sorted(preds[n].items()) if by_source else preds[n].items()
            if data["kind"] == "collective":
                self.collectives.append(n - a)
                if data["collective"] in ("send", "recv"):
                    self.moving[n - a] = ("tag", None)
            elif data["kind"] == "tensor":
                named = data["name"] != f"t{n}"  # state written in place keeps its name; the others are renamed
                if named:
                    self.state.append(n - a)  # (_state)
                if not named or data["version"]:
                    earlier = [t for w, _ in inputs for t in (sorted(preds[w]) if by_source else preds[w])
                               if nodes[t]["version"] == data["version"] - 1
                               and nodes[t]["shape"] == data["shape"]] if data["version"] else []
                    self.moving[n - a] = ("named" if named else "tensor", earlier[0] if earlier else None)
            for u, e in inputs:
                edges.append((u - a, True, n - a, e) if a <= u < b else (u, False, n - a, e))
        # a copy's inputs from outside it are made before it, as the probed step's are: the same roots
        self.roots = [n - a for n in _roots(probe, a, b)]

    def copy(self, base: int, tag_shift: int, image, placed: dict | list, latest: dict) -> list[dict]:
        """The nodes' attributes for a copy at `base`, `tag_shift` tag pairs later (micro-batches times chunks):
        a send's or recv's tag (the micro-batch's), default tensor names, and the version of a tensor written in
        place (one past its earlier version there, e.g. a gradient accumulated over one more micro-batch; for a
        parameter or buffer, one past its `latest`; what the copy writes is left in `written`). `placed`: the
        attributes of the nodes placed before, by node."""
        nodes = list(self.nodes)
        for off, (what, earlier) in self.moving.items():
            data = nodes[off]
            if what == "tag":
                nodes[off] = {**data, "tag": data["tag"] + 2 * tag_shift}  # pipeline.tag: 2(mV + c) (+1 for gradients)
                continue
            data = {**data, "name": f"t{base + off}"} if what == "tensor" else dict(data)
            if earlier is not None:
                inside = earlier - self.a
                before = nodes[inside] if 0 <= inside < len(nodes) else placed[image(earlier)]
                data["version"] = before["version"] + 1
            nodes[off] = data
        written = {}  # what this copy writes, into `latest` once its in-edges are placed (they read the earlier)
        for off in self.state:
            data = nodes[off]
            before = written.get(data["name"], latest.get(data["name"]))
            if data["version"] and before is not None:
                nodes[off] = data = {**data, "version": before[1] + 1}
            written[data["name"]] = (base + off, data["version"])
        self.written = written
        return nodes


def copy_graph(graph: TraceGraph, by_source: bool = False) -> TraceGraph:
    """A copy whose node, edge and graph attributes can change without changing `graph`'s. Edges go in by
    target, each one's inputs in their order, as the tracer added them (which level views keep); `by_source`:
    by source, as shift_stage copies them."""
    out = TraceGraph(**graph.graph)
    edges = ((u, v, e) for u, targets in graph.succs.items() for v, e in targets.items()) if by_source else \
        ((u, v, e) for v, sources in graph.preds.items() for u, e in sources.items())
    out.append((dict(d) for d in graph.node_attrs.values()), ((u, v, dict(e)) for u, v, e in edges))
    return out


def _state(n: int, d: dict) -> bool:
    """A parameter or buffer: a tensor the tracer named (others keep their default name t<node>)."""
    return d["kind"] == "tensor" and d["name"] != f"t{n}"


def _renumber_orders(graph: TraceGraph, collectives: list[int] | None = None) -> None:
    """Each collective's `order` among its group's in the graph, in a new attribute dict (a shared one is the
    probe's: schedule_stage's `share`); `collectives`: the graph's, in order, when known."""
    counts, nodes = {}, graph.node_attrs
    for n in [n for n, _ in graph.collectives()] if collectives is None else collectives:
        d = nodes[n]
        key = tuple(d["group"])
        nodes[n] = {**d, "order": counts.get(key, 0)}
        counts[key] = nodes[n]["order"] + 1


def set_schedule(graph: TraceGraph, plan, order, starts, roots=None) -> TraceGraph:
    """`graph` (a stage's steps in `order`, step k from node starts[k]) with its schedule recorded and run in
    order (add_schedule_deps; `roots`: its)."""
    graph.graph.update(schedule_attrs(plan, order))
    add_schedule_deps(graph, starts, roots)
    return graph


def schedule_attrs(plan, order) -> dict:
    """The graph attributes that record a stage's schedule (its steps in `order`)."""
    return dict(schedule=plan.schedule, microbatches=plan.microbatches,
                pipeline_schedule=[f"{kind}{m}" + (f".{c}" if plan.virtual_stages > 1 else "")
                                   for kind, m, c in order if kind != "optimizer"])


def add_schedule_deps(graph: TraceGraph, starts: list[int], roots: list | None = None) -> None:
    """Step k (nodes from starts[k] to starts[k+1]) runs after step k-1: its first nodes (those with no
    producer inside the step: _roots) read a 0-byte tensor written by step k-1's last node. `roots`: each
    step's first nodes, when known (a copied step's are those of the step it copies, moved)."""
    bounds, nodes = [*starts, len(graph)], graph.node_attrs
    for k in range(1, len(starts)):
        start, end = bounds[k], bounds[k + 1]
        last = next((n for n in range(start - 1, bounds[k - 1] - 1, -1) if nodes[n]["kind"] != "tensor"), None)
        firsts = roots[k] if roots else _roots(graph, start, end)
        if last is None or not firsts:
            continue
        token = graph.add_tensor([], "none", 0, name=f"schedule[{k}]", device="meta")
        graph.add_data_edge(last, token, len(graph.succs[last]))
        for n in firsts:
            graph.add_data_edge(token, n, len(graph.preds[n]))


def _roots(graph: TraceGraph, start: int, end: int) -> list[int]:
    """The ops and collectives from `start` to `end` whose inputs were all made before `start`."""
    nodes, pred = graph.node_attrs, graph.preds
    return [n for n in range(start, end) if nodes[n]["kind"] != "tensor" and _made_before(pred, n, start)]


def _made_before(pred: dict, n: int, start: int) -> bool:
    """Were all of node n's inputs made before node `start`? (Loops, not any() over a generator: asked of
    every node of a stage's step.)"""
    for t in pred[n]:
        for p in pred[t]:
            if p >= start:
                return False
    return True
