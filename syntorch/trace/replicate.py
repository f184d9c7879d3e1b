"""Symbolic scale: trace one transformer layer and replicate it, instead of running all of them.

On `meta` a 96-layer model spends nearly all its time in Python meta kernels of identical layers. Every
layer's trace is the same but for names, so we run the model with its first layer only (the other modules
shared) and rebuild the full graph: each recorded call of that layer is copied once per layer, in order,
with `layers.0` renamed, the residual stream chained from one copy to the next, and state a layer keeps
across passes (parameters, KV-cache versions) linked to the same copy of earlier passes. Node ids come
out in the order a full trace creates them, and `order` of collectives is renumbered, so the result
equals a full trace (tests/trace/test_tracer.py checks it).
"""
from dataclasses import dataclass

import torch.nn as nn

from syntorch.models import module_view
from syntorch.trace.graph import TraceGraph, no_gc


@dataclass
class LayerCall:
    """One forward call of a transformer layer: the node ids it created ([start, end)), its input and output."""
    path: str
    start: int
    end: int
    input: int
    output: int


def first_layer_only(model: nn.Module) -> nn.Module:
    """A shallow copy of `model` whose `layers` hold only the first one (all modules shared, none copied)."""
    shallow = module_view(model)
    shallow.layers = nn.ModuleDict(dict([next(iter(model.layers.items()))]))
    return shallow


def replicate_layers(graph: TraceGraph, calls: list[LayerCall], layer_names: list[str]) -> TraceGraph:
    """The graph of a run in which every call in `calls` (all of layer `layer_names[0]`) ran once per
    layer in `layer_names`, in that order."""
    with no_gc():
        return _replicate(graph, calls, layer_names)


def _replicate(graph: TraceGraph, calls: list[LayerCall], layer_names: list[str]) -> TraceGraph:
    out = _Copies(graph)
    outside: dict[int, int] = {}  # old id -> new id, for nodes not made by a layer call
    owner = {n: i for i, c in enumerate(calls) for n in range(c.start, c.end)}
    copies: list[list[dict[int, int]]] = []  # per call, per layer: old id -> new id
    node, n = 0, len(graph)
    while node < n:
        if len(copies) < len(calls) and node == calls[len(copies)].start:
            call = calls[len(copies)]
            copies.append(_copy_call(out, call, layer_names, outside, owner, copies))
            outside[call.output] = copies[-1][-1][call.output]  # later readers of the output see the last layer's
            node = call.end
            continue
        outside[node] = out.add(node, outside.__getitem__)
        node += 1
    return out.graph()


def _copy_call(out: "_Copies", call, layer_names, outside, owner, copies) -> list[dict[int, int]]:
    olds = range(call.start, call.end)
    # each node's attribute that holds the layer's name, and what follows the name: found once, not per layer
    sites = [_site(out.attrs[old], call.path) for old in olds]
    maps = []
    for k, name in enumerate(layer_names):
        here = {call.input: maps[-1][call.output]} if k else {}

        def find(u, here=here, k=k):
            if u in here:
                return here[u]
            if u in owner:  # made by an earlier call of this layer: the same layer's copy of it
                return copies[owner[u]][k][u]
            return outside[u]

        for old, site in zip(olds, sites):
            here[old] = out.add(old, find, site and (site[0], name + site[1]))
        maps.append(here)
    return maps


class _Copies:
    """Nodes and edges copied from `source`, collected in lists and added to a new graph at once."""

    def __init__(self, source: TraceGraph):
        self.source = source
        self.attrs, self.preds = source.node_attrs, source.preds  # networkx's dicts: its views are slower
        self.nodes: list[dict] = []  # node i's attributes, new dicts the graph takes as they are
        self.edges: list[tuple[int, int, dict]] = []

    def add(self, old: int, find, renamed=None) -> int:
        """A copy of node `old`; `renamed`: (attribute, new value)."""
        attrs = dict(self.attrs[old])
        new = len(self.nodes)
        if renamed:
            attrs[renamed[0]] = renamed[1]
        if attrs["name"] == f"t{old}":  # an unnamed tensor is named by its id
            attrs["name"] = f"t{new}"
        self.nodes.append(attrs)
        self.edges.extend((find(u), new, dict(edge)) for u, edge in self.preds[old].items())
        return new

    def graph(self) -> TraceGraph:
        out = TraceGraph(**self.source.graph)
        out.append(self.nodes, self.edges, copy=False)
        _renumber_collectives(out)
        return out


def _site(attrs: dict, layer: str) -> tuple[str, str] | None:
    """(the attribute naming the node in `layer`, what follows the layer's name in it), or None: a tensor's
    name, an op's or a collective's module."""
    key = "name" if attrs["kind"] == "tensor" else "module"
    path = attrs[key]
    if path == layer or path.startswith(layer + "."):
        return key, path[len(layer):]
    return None


def _renumber_collectives(graph: TraceGraph):
    seen: dict[tuple, int] = {}
    for _, d in graph.collectives():
        key = tuple(d["group"])
        d["order"] = seen.get(key, 0)
        seen[key] = d["order"] + 1
    graph.__dict__.pop("_orders", None)
