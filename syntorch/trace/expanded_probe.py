"""A whole stage's probe for the Chakra files, derived from a probe of fewer layers: node for node the graph
(and step blocks) training.probe_stage gives when it runs every layer.

layer_probe.py probes each run of alike layers with its first four layers; a step of the stage meets them
in order (forward) or in reverse (backward), and the third it meets, its period, stands for the run's other
layers (see its docstring). Here every period the step meets is placed by the layer of the whole stage it
is: the first three keep theirs, copies of the third follow it, and the fourth becomes the run's last. A
copy is renamed to its layer (layer indices in module and tensor names), and reads what the period read,
moved by the same number of layers: the node at the same place in the period of the layer as far from its
own as the period's source was (a backward reads its layer's forward, the layer's input from the layer
before). Other nodes of the step keep their sources, with the fourth layer renamed to the run's last.

What the probe cannot show is the whole stage's state and its end of backward: probe_optimizer traces those
on the whole stage (its parameters, buffers and optimizer state are the whole probe's first nodes), given
the gradients' versions where that end starts and the gradient accumulated last, so its end of backward
reads them as the whole probe's does; its reads of them, and of the buckets overlap launched before, are
joined to the expanded steps' nodes. Node names that are ids (t<n>) and collectives' order follow the
whole graph. A stage whose probe cannot be expanded so (FSDP, CP; or a period whose neighbours do not look
alike, or a node outside the periods in a middle layer) gets None: it is probed whole.
"""
import dataclasses

from syntorch.models import LAYER_PATH, layer_path
from syntorch.trace.graph import TraceGraph, no_gc
from syntorch.trace.layer_probe import KeptLayers, _periods, _role, reduced
from syntorch.trace.training import Gradients, _renumber_orders, probe_optimizer, probe_stage, stage_world


@dataclasses.dataclass
class _Steps:
    """A probe's steps, up to where the end of the last backward starts, numbered from 0: node attributes
    (tensor names that are ids as None), in-edges ({source: attributes}; a source before the steps by its
    name, an unnamed one as "#<k>", the k-th), step blocks, the node of each parameter's gradient and of
    each bucket overlap launched."""
    nodes: list
    preds: list
    blocks: dict
    grads: dict
    flats: list  # the nodes of the buckets overlap launched, in order

    @property
    def node_attrs(self):  # what layer_probe._periods reads
        return self.nodes


def expanded_probe(config, plan, stage: int, dtype, microbatches: int, rank: int | None = None):
    """probe_stage(config, plan, stage, dtype, rank, microbatches) from a probe of fewer layers, or None."""
    cut = reduced(config, plan, stage)
    if cut is None or plan.zero == 3 or plan.cp > 1:
        return None
    rank = plan.mesh.representative(stage) if rank is None else rank
    with no_gc(), stage_world(config, plan.mesh, rank) as groups:  # both probes in one world: its groups once
        fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.init}
        finish, grads = [], Gradients()
        graph, blocks = probe_stage(config, KeptLayers(**fields, kept=(stage, cut[0])), stage, dtype, rank,
                                    microbatches=microbatches, finish=finish, grads=grads, groups=groups)
        steps = _steps(graph, blocks, finish[0], grads) if finish else None
        for run in cut[1] if steps else ():
            steps = steps and _expand(steps, run)
        if steps is None or grads.last not in (None, *steps.grads):
            return None
        given = Gradients({name: steps.nodes[n]["version"] for name, n in steps.grads.items()}, last=grads.last)
        end = []
        whole, whole_blocks = probe_optimizer(config, plan, stage, dtype, rank, finish=end, grads=given, groups=groups)
        return _joined(steps, whole, whole_blocks, end[0], given.nodes)


def _steps(graph: TraceGraph, blocks: dict, finish: int, grads: Gradients) -> _Steps | None:
    """The probe's steps up to `finish` as _Steps."""
    first = min(start for key, (start, _) in blocks.items() if key[0] != "optimizer")
    unnamed = [n for n in range(first) if graph.node_attrs[n]["name"] == f"t{n}"]
    outside = {n: graph.node_attrs[n]["name"] for n in range(first)} | {n: f"#{k}" for k, n in enumerate(unnamed)}
    nodes = [_unnamed(n, graph.node_attrs[n]) for n in range(first, finish)]
    preds = [{(u - first if u >= first else outside[u]): e for u, e in graph.preds[n].items()}
             for n in range(first, finish)]
    kept = {key: (max(a, first) - first, min(b, finish) - first) for key, (a, b) in blocks.items()
            if key[0] != "optimizer"}
    if any(not first <= n < finish for n in [*grads.nodes.values(), *grads.flats]):
        return None
    return _Steps(nodes, preds, kept, {name: n - first for name, n in grads.nodes.items()},
                  [n - first for n in grads.flats])


def _unnamed(n: int, d: dict) -> dict:
    return {**d, "name": None} if d["kind"] == "tensor" and d["name"] == f"t{n}" else d


def _expand(steps: _Steps, run: tuple) -> _Steps | None:
    """`steps` with the run (chunk, its four kept layers, copies) at its whole length, or None."""
    chunk, kept, copies = run
    places = {}  # step start -> its _Place
    for key, (start, end) in steps.blocks.items():
        if key[2] == chunk:
            place = _place(steps, start, end, kept, copies)
            if place is None:
                return None
            places[start] = place
    return _Copier(steps, kept, copies, places).steps()


@dataclasses.dataclass
class _Place:
    """Where a step's four kept layers' periods are (`starts`: their first nodes, `size` nodes each, in the
    order met), their layers in the probe (`layers`) and in the whole stage (`whole`: the layer of each period
    as the whole step meets them, the copies after the third), and of each period the nodes (offsets from its
    start, [lo, hi)) that run what the third's do: the first and the last period met may be cut short by
    what comes before and after them (the stage's first layer's backward ends in what it sends back)."""
    start: int
    end: int
    starts: list
    size: int
    layers: list
    whole: list
    spans: list


def _place(steps: _Steps, start: int, end: int, kept: tuple, copies: int) -> _Place | None:
    found = _periods(steps, start, end, (None, kept, copies))
    if found is None or found[2] + 1 >= end:
        return None
    before, first, second = found
    size = second - first
    starts = [before + 1 - size, before + 1, first + 1, second + 1]
    period = [_role(steps.nodes[n]) for n in range(starts[2], starts[2] + size)]
    head = next((k for k in range(size) if starts[0] + size - 1 - k < start or
                 _role(steps.nodes[starts[0] + size - 1 - k]) != period[size - 1 - k]), size)
    tail = next((k for k in range(size) if starts[3] + k >= end or _role(steps.nodes[starts[3] + k]) != period[k]), size)
    layers = [_layer(next(d for d in reversed(steps.nodes[s:s + size]) if d["kind"] != "tensor")) for s in starts[1:3]]
    ascending = [kept[1], kept[2]] == layers
    if not ascending and [kept[2], kept[1]] != layers:
        return None
    whole = list(range(kept[0], kept[3] + copies + 1))
    return _Place(start, end, starts, size, list(kept) if ascending else list(reversed(kept)),
                  whole if ascending else whole[::-1], [(size - head, size), (0, size), (0, size), (0, tail)])


def _layer(d: dict) -> int | None:
    match = LAYER_PATH.match(d.get("module") or "")
    return int(match.group(1)) if match else None


class _Copier:
    """Builds the expanded steps: each step's nodes with copies of its third period, and their edges."""

    def __init__(self, steps: _Steps, kept: tuple, copies: int, places: dict):
        self.old, self.kept, self.copies, self.places = steps, kept, copies, places
        self.new = {}  # old node -> new node (the original's place)
        self.periods = {}  # (step start, whole layer) -> (new first node of its period, its span)
        shift = 0
        for key, (start, end) in sorted(steps.blocks.items(), key=lambda item: item[1]):
            place = places.get(start)
            for n in range(start, end):
                if place and n == place.starts[3]:
                    shift += copies * place.size
                self.new[n] = n + shift
            for k, layer in enumerate(place.whole if place else ()):  # k: the period's place in the step
                at = self.new[place.starts[2]] + (k - 2) * place.size if 2 < k < 3 + copies else \
                    self.new[place.starts[min(k, 3)] if k < 3 else place.starts[3]]
                span = place.spans[k] if k < 3 else (0, place.size) if k < 3 + copies else place.spans[3]
                self.periods[start, layer] = at, *span
        self.region = {}  # old node in a period -> (step start, its layer in the probe, offset)
        for start, place in places.items():
            for s, layer, (lo, hi) in zip(place.starts, place.layers, place.spans):
                for n in range(s + lo, s + hi):
                    self.region[n] = start, layer, n - s

    def steps(self) -> _Steps | None:
        nodes, preds, old = [], [], self.old
        try:
            for start, end in sorted(old.blocks.values()):
                place = self.places.get(start)
                for n in range(start, end):
                    if place and n == place.starts[3]:
                        source = place.starts[2]
                        for k in range(1, self.copies + 1):
                            shift = place.whole[2 + k] - place.layers[2]
                            for m in range(source, source + place.size):
                                nodes.append(self._renamed(old.nodes[m], shift))
                                preds.append(self._edges(m, shift))
                    shift = self._shift(n)
                    nodes.append(self._renamed(old.nodes[n], shift))
                    preds.append(self._edges(n, shift))
            grads = self._grads()
        except _Outside:
            return None
        blocks = {key: (self.new[a], self.new[b - 1] + 1) for key, (a, b) in old.blocks.items()}
        return _Steps(nodes, preds, blocks, grads, sorted(at for n in self.old.flats for at in self._images(n)))

    def _shift(self, n: int) -> int | None:
        """How many layers node n moves in the whole stage (None: outside the periods)."""
        if n not in self.region:
            return None
        start, layer, _ = self.region[n]
        place = self.places[start]
        k = place.layers.index(layer)
        return place.whole[k if k < 3 else 3 + self.copies] - layer

    def _renamed(self, d: dict, shift: int | None) -> dict:
        key = "name" if d["kind"] == "tensor" else "module"
        name = d[key] and self._rename(d[key], shift)
        return d if name == d[key] else {**d, key: name}

    def _rename(self, name: str, shift: int | None) -> str:
        """A name in a node `shift` layers on (None: outside the periods, where only the run's last kept
        layer moves, to the run's last)."""
        match = LAYER_PATH.match(name)
        if not match:
            return name
        layer = int(match.group(1))
        if shift is None:
            if self.kept[0] < layer < self.kept[3]:
                raise _Outside
            shift = self.copies if layer == self.kept[3] else 0
        return LAYER_PATH.sub(layer_path(layer + shift), name)

    def _edges(self, n: int, shift: int | None) -> dict:
        """Node n's in-edges in a node `shift` layers on: a period's reads move as far (None: outside the
        periods, where an op of the run's first or last kept layer moves as that layer does, and one of
        no layer of the run reads as the outside names)."""
        out, d = {}, self.old.nodes[n]
        for u, e in self.old.preds[n].items():
            if isinstance(u, str):
                out[self._rename(u, shift)] = e
            elif u not in self.region or (shift is None and d["kind"] == "tensor"):  # an output: its op's place
                out[self.new[u]] = e
            else:
                start, layer, offset = self.region[u]
                moved = shift if shift is not None else self._outside_shift(d, layer)
                at, lo, hi = self.periods.get((start, layer + moved), (0, 0, 0))
                if not lo <= offset < hi:
                    raise _Outside
                out[at + offset] = e
        return out

    def _outside_shift(self, d: dict, read: int) -> int:
        """How far an op outside the periods moves what it reads of layer `read`: as its own layer moves, if
        the run's first or last kept one; else as the layer read is renamed outside the periods."""
        own = _layer(d)
        layer = own if own in (self.kept[0], self.kept[3]) else read
        if layer not in (self.kept[0], self.kept[3]):
            raise _Outside
        return self.copies if layer == self.kept[3] else 0

    def _grads(self) -> dict:
        """Each parameter's gradient node in the expanded steps: the original's, renamed, and for the
        copies' layers the copy of the node of the copied period's layer. Raises _Outside unless every layer
        of the run has as many."""
        out = {}
        for name, n in self.old.grads.items():
            images = self._images(n)
            out[self._rename(name, self._shift(n))] = images[0]
            if len(images) > 1:
                start, layer, _ = self.region[n]
                moved = self.places[start].whole
                out.update((self._rename(name, moved[2 + k] - layer), images[k]) for k in range(1, self.copies + 1))
        layers = [_layer({"module": name}) for name in out]
        if len({layers.count(i) for i in range(self.kept[0], self.kept[3] + self.copies + 1)}) > 1:
            raise _Outside
        return out

    def _images(self, n: int) -> list[int]:
        """Node n's place in the expanded steps, then (in the copied period) its copies'."""
        if n not in self.region or self.region[n][1] != self.places[self.region[n][0]].layers[2]:
            return [self.new[n]]
        start, layer, offset = self.region[n]
        place = self.places[start]
        return [self.new[n], *(self.periods[start, place.whole[2 + k]][0] + offset for k in range(1, self.copies + 1))]


class _Outside(Exception):
    """A node outside the periods names a middle kept layer, or a period reads beyond the run."""


def _joined(steps: _Steps, whole: TraceGraph, blocks: dict, end: int, grads: dict) -> tuple | None:
    """The whole stage's probe: probe_optimizer's first nodes (the stage's state), the expanded steps, and
    probe_optimizer's end of backward and optimizer step reading the steps' gradients and bucket outputs."""
    flats = {n: int(d["name"].rsplit(".", 1)[1]) for n, d in whole.node_attrs.items()
             if n < end and d["kind"] == "tensor" and d["name"].startswith("grad_sync.flat.")}
    registered = {n: name for name, n in grads.items()}
    state = [n for n in range(end) if n not in flats and n not in registered]
    base = len(state)
    new = {n: i for i, n in enumerate(state)}
    unnamed = [i for i, n in enumerate(state) if whole.node_attrs[n]["name"] == f"t{n}"]
    renamed = set(unnamed)
    named = {whole.node_attrs[n]["name"]: i for i, n in enumerate(state)}
    launched = [base + v for v in steps.flats]
    if len(launched) != len(flats) or any(name not in steps.grads for name in registered.values()):
        return None
    new.update({n: launched[k] for n, k in flats.items()})
    new.update({n: base + steps.grads[name] for n, name in registered.items()})
    after = base + len(steps.nodes) - end
    new.update({n: n + after for n in range(end, len(whole))})

    def source(u):
        if isinstance(u, int):
            return base + u
        return unnamed[int(u[1:])] if u.startswith("#") else named[u]

    nodes = [{**whole.node_attrs[n], "name": f"t{i}"} if i in renamed else whole.node_attrs[n]
             for i, n in enumerate(state)]
    nodes += [{**d, "name": f"t{base + v}"} if d["name"] is None else d for v, d in enumerate(steps.nodes)]
    nodes += [{**whole.node_attrs[n], "name": f"t{n + after}"} if whole.node_attrs[n]["name"] == f"t{n}"
              else whole.node_attrs[n] for n in range(end, len(whole))]
    try:
        edges = [(new[u], i, e) for i, n in enumerate(state) for u, e in whole.preds[n].items()]
        edges += [(source(u), base + v, e) for v in range(len(steps.nodes)) for u, e in steps.preds[v].items()]
    except (KeyError, IndexError):  # state the steps read that the whole stage lacks
        return None
    edges += [(new[u], n + after, e) for n in range(end, len(whole)) for u, e in whole.preds[n].items()]
    out = TraceGraph(**whole.graph)
    out.append(nodes, edges)
    _renumber_orders(out)
    found = {key: (base + a, base + b) for key, (a, b) in steps.blocks.items()}
    last = max(found, key=lambda key: found[key][1])
    optimizer = [(a + after, b + after) for key, (a, b) in blocks.items() if key[0] == "optimizer"]
    found[last] = (found[last][0], optimizer[0][0] if optimizer else len(out))
    return out, {**found, **({("optimizer", None, None): optimizer[0]} if optimizer else {})}

