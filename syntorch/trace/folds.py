"""Repeated layers and decode steps folded for drawing: `fold_repeated_layers` keeps one copy of each run of
identical consecutive layers, then `fold_repeated_steps` one of each run of identical consecutive decode
steps (views too: the traced graph is never changed)."""
import re
from collections import Counter
from dataclasses import dataclass

from syntorch.models import LAYER_PATH
from syntorch.trace.graph import TraceGraph
from syntorch.trace.levels import layer_of

_RUNNING = re.compile(r"'name': 't\d+'|'order': \d+")  # tensor names that are ids, collective counters


# --- repeated layers, folded for drawing --------------------------------------------------------------

def layer_blocks(graph: TraceGraph) -> list[tuple[str, str, list[int]]]:
    """(phase, layer, nodes) for each contiguous run of ops and collectives of one layer_of() key and
    phase, in traced order; nodes: those ops and collectives, then the block's tensors. A tensor belongs
    to its producer's block, or its first reader's if nothing produced it (parameters, caches); a tensor
    that nothing touches is in no block."""
    return _blocks(graph)[0]


def _blocks(graph: TraceGraph, by_layer: bool = True) -> tuple[list, dict]:
    """layer_blocks (or, not `by_layer`, blocks of one phase each, their layer ""), and each node's block index."""
    blocks, block_of, tensors, last, layers = [], {}, [], None, {}
    for node, d in graph.node_attrs.items():
        if d["kind"] == "tensor":
            tensors.append(node)
            continue
        module = d["module"] if by_layer else ""
        if module not in layers:
            layers[module] = layer_of(module)
        here = (d["phase"], layers[module])
        if here != last:
            blocks.append((*here, []))
            last = here
        block_of[node] = len(blocks) - 1
        blocks[-1][2].append(node)
    pred, succ = graph.preds, graph.succs
    for node in tensors:
        if pred[node]:
            block_of[node] = block_of[next(iter(pred[node]))]
        elif succ[node]:
            block_of[node] = min(block_of[r] for r in succ[node])
        else:
            continue
        blocks[block_of[node]][2].append(node)
    return blocks, block_of


def fold_repeated_layers(graph: TraceGraph) -> tuple[TraceGraph, dict[tuple[str, str, int], list[str]]]:
    """The graph with each run of identical consecutive layers (within a phase) kept once, and
    {(phase, kept layer, k): the layers it stands for} for runs of two or more, k counting the earlier
    kept blocks of that phase and layer: a pipeline stage runs layers.0-5 once per micro-batch, all in
    phase "forward", and each micro-batch's run is a box of its own. Identical means the same
    nodes and edges with the same attributes once the layer's own name is taken out of names (ops,
    shapes, FLOPs, bytes, collectives and their groups), so a layer that differs stays on its own.
    Edges between the folded copies are dropped; edges to and from the rest of the graph move to the
    kept copy, so what feeds the first layer and what reads the last still connect."""
    blocks, block_of = _blocks(graph)
    signatures = [_signature(graph, layer, nodes) if LAYER_PATH.match(layer) else None for _, layer, nodes in blocks]
    image, group, repeats = {}, [], {}  # group: each block's first block in its run
    keys, seen = {}, Counter()  # each kept block's key in `repeats`
    for i, (phase, layer, nodes) in enumerate(blocks):
        first = group[-1] if group else 0
        if i and signatures[i] is not None and signatures[i] == signatures[first] and phase == blocks[first][0] \
                and abs(_index(layer) - _index(blocks[i - 1][1])) == 1:
            image.update(zip(nodes, blocks[first][2]))  # same signature: same length, node for node
            repeats.setdefault(keys[first], [blocks[first][1]]).append(layer)
            group.append(first)
        else:
            group.append(i)
            keys[i] = (phase, layer, seen[phase, layer])
            seen[phase, layer] += 1
    return _folded(graph, image, block_of, group), repeats


def _index(layer: str) -> int:
    return int(layer.rsplit(".", 1)[1])


def _signature(graph: TraceGraph, layer: str, nodes: list[int]) -> tuple:
    """What must match for two layers to be drawn as one: every node's attributes, with the layer's own
    name taken out (layers.7.attn.qkv -> *.attn.qkv), tensor names that are only ids ("t123") and
    collectives' `order` (a running count) dropped; the edges into each node by position in the block
    (None: from outside it) and argument; which nodes are read outside the block. The attributes are
    compared as their repr: one C call per block instead of Python work per field."""
    local = {n: i for i, n in enumerate(nodes)}
    pred, succ, attrs = graph.preds, graph.succs, graph.node_attrs
    text = repr([attrs[n] for n in nodes]).replace(f"'{layer}.", "'*.").replace(f"'{layer}'", "'*'")
    inputs = [(i, local.get(p), e.get("arg")) for i, n in enumerate(nodes) for p, e in pred[n].items()]
    read_outside = [i for i, n in enumerate(nodes) if not succ[n].keys() <= local.keys()]
    return _RUNNING.sub("", text), inputs, read_outside


def _folded(graph: TraceGraph, image: dict, block_of: dict, group: list, extra: dict | None = None) -> TraceGraph:
    """`graph` without the nodes in `image`, their edges moved to the nodes they map to; edges from one copy
    of a layer to the next would loop on the kept copy, so they go. `extra`: {node: attributes to add}."""
    kept = [n for n in graph.node_attrs if n not in image]
    new = {n: i for i, n in enumerate(kept)}
    new.update((n, new[image[n]]) for n in image)
    edges = {}
    for u, readers in graph.succs.items():
        bu = block_of.get(u)
        for v, e in readers.items():
            bv = block_of[v]
            if bu == bv or group[bu] != group[bv]:
                edges.setdefault((new[u], new[v]), e)
    out = TraceGraph(**graph.graph)
    extra, attrs = extra or {}, graph.node_attrs
    out.append((attrs[n] if n not in extra else {**attrs[n], **extra[n]} for n in kept),
               ((u, v, e) for (u, v), e in edges.items()))
    return out


# --- identical decode steps, folded for drawing ---------------------------------------------------------

DECODE_STEP = re.compile(r"decode\[(\d+)\]")
# the step's own name; how often a KV cache was written so far; a pipeline's p2p tag, a message's number
_STEP_OWN = ("phase", "version", "tag")
_FOLLOW_SHAPES = ("shape", "bytes", "flops", "dense_flops", "bytes_read", "bytes_written", "duration_us")


def step_index(phase: str) -> int | None:
    """decode[7] -> 7; other phases (prefill, forward, ...) -> None."""
    match = DECODE_STEP.fullmatch(phase)
    return int(match.group(1)) if match else None


@dataclass
class StepRun:
    """Consecutive decode steps drawn as one: their phases, and the KV length in the first and the last
    step when shapes grow with it (None when no shape changes from step to step)."""
    phases: list[str]
    kv: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        return step_span(self.phases)

    @property
    def title(self) -> str:
        return self.label + (f", KV length {self.kv[0]}–{self.kv[1]}" if self.kv else "")


def step_span(phases: list[str]) -> str:
    """[decode[0], ..., decode[18]] -> decode[0–18] × 19; one phase stays its name."""
    if len(phases) == 1:
        return phases[0]
    return f"decode[{step_index(phases[0])}–{step_index(phases[-1])}] × {len(phases)}"


def grown_entries(first: list, later: list, steps: int) -> list[tuple[int, int]] | None:
    """(shape, dimension) of each entry that differs between two steps' shape lists, when every such entry
    grew by exactly `steps` (one a step: the KV length); None when the shapes differ otherwise."""
    if len(first) != len(later):
        return None
    grown = []
    for i, (a, b) in enumerate(zip(first, later)):
        if len(a) != len(b):
            return None
        for dim, (x, y) in enumerate(zip(a, b)):
            if x != y:
                if y - x != steps:
                    return None
                grown.append((i, dim))
    return grown


def fold_repeated_steps(graph: TraceGraph, repeats: dict) -> tuple[TraceGraph, dict[str, StepRun]]:
    """`graph` (layers already folded: fold_repeated_layers and its `repeats`) with each run of identical
    consecutive decode steps kept once (the first), and {first step's phase: StepRun} for runs of two or
    more; a kept tensor whose shape grows gets `last_shape`, its shape in the run's last step, for labels.

    Identical: the same nodes and edges with the same attributes (ops, modules, dtypes, collectives with
    their groups and bytes, the same layers folded) except the step's own name, tensor ids, running counts
    (collectives' order, p2p tags, cache versions) and what grows with the KV length: tensor shapes may
    differ only in entries that grow by one a step, and only ops reading or writing such a tensor may differ
    in FLOPs, bytes and time. What only later steps read (the KV cache written, the next token) may be
    missing from a step: nothing reads the last step's. Prefill and any other phase is never folded."""
    blocks, block_of = _blocks(graph, by_layer=False)
    signatures = [_step_signature(graph, nodes, repeats, phase) if step_index(phase) is not None else None
                  for phase, _, nodes in blocks]
    image, group, runs, last_shape = {}, [], {}, {}
    for i, (phase, _, nodes) in enumerate(blocks):
        first = group[-1] if group else 0
        kept, here = signatures[first], signatures[i]
        run = runs.get(blocks[first][0]) or StepRun([blocks[first][0]])
        steps = step_index(phase) - step_index(run.phases[0]) if kept and here else None
        grown = _same_step(kept, here, steps) if steps == len(run.phases) else None
        if grown is None:
            group.append(i)
            continue
        image.update(zip(here.core, kept.core))
        image.update((n, kept.outward[key]) for key, n in here.outward.items())
        last_shape.update((kept.core[kept.tensor_at[t]], {"last_shape": list(here.shapes[t])}) for t, _ in grown)
        runs[run.phases[0]] = run
        run.phases.append(phase)
        if grown and run.kv is None:
            shape, dim = grown[0]
            run.kv = (kept.shapes[shape][dim],) * 2
        run.kv = run.kv and (run.kv[0], run.kv[0] + steps)
        group.append(first)
    return (_folded(graph, image, block_of, group, last_shape) if image else graph), runs


@dataclass
class _Step:
    """A decode step as fold_repeated_steps compares it. core: its nodes less `outward`, the tensors nothing
    in the step reads, by (producer's position in core, argument, attributes less shapes)."""
    core: list
    outward: dict
    exact: tuple  # what must match
    tensor_at: list  # the position in core of each tensor
    shapes: list  # each tensor's shape
    near: list  # each node's neighbours' positions in core
    follow: list  # each node's fields that follow from shapes


def _step_signature(graph: TraceGraph, nodes: list[int], repeats: dict, phase: str) -> _Step:
    """Attributes compared as _signature compares layers', less _STEP_OWN and _FOLLOW_SHAPES."""
    pred, succ, attrs = graph.preds, graph.succs, graph.node_attrs
    inside = set(nodes)
    core = [n for n in nodes if attrs[n]["kind"] != "tensor" or succ[n].keys() & inside]
    local = {n: i for i, n in enumerate(core)}

    def plain(d):
        return {k: v for k, v in d.items() if k not in _STEP_OWN and (k not in _FOLLOW_SHAPES or
                                                                      d["kind"] == "collective")}
    outward = {}
    for n in nodes:
        if n not in local:
            producer, edge = next(iter(pred[n].items()))
            outward[local[producer], edge.get("arg"), _RUNNING.sub("", repr(plain(attrs[n])))] = n
    follow = [tuple(attrs[n].get(k) for k in _FOLLOW_SHAPES[1:]) if attrs[n]["kind"] != "collective" else ()
              for n in core]
    tensor_at = [i for i, n in enumerate(core) if attrs[n]["kind"] == "tensor"]
    # which inputs come from outside the step, not from how many nodes: a step after one whose layers
    # differ reads each layer's KV cache from its own node, a step after a folded one from one
    inputs = sorted({(i, local.get(p), e.get("arg")) for i, n in enumerate(core) for p, e in pred[n].items()},
                    key=str)
    layers = sorted((k[1:], v) for k, v in repeats.items() if k[0] == phase)
    exact = (_RUNNING.sub("", repr([plain(attrs[n]) for n in core])), inputs, layers, tensor_at)
    return _Step(core, outward, exact, tensor_at, [list(attrs[core[i]]["shape"]) for i in tensor_at],
                 [{local[t] for t in (*pred[n], *succ[n]) if t in local} for n in core], follow)


def _same_step(first: _Step, later: _Step, steps: int) -> list | None:
    """grown_entries() between two steps `steps` apart when they are identical as fold_repeated_steps
    says, else None."""
    if first.exact != later.exact or not later.outward.keys() <= first.outward.keys():
        return None
    grown = grown_entries(first.shapes, later.shapes, steps)
    if grown is None:
        return None
    varying = {first.tensor_at[shape] for shape, _ in grown}  # positions of the tensors that grew
    for i, (a, b) in enumerate(zip(first.follow, later.follow)):
        if a != b and i not in varying and not first.near[i] & varying:
            return None
    return grown
