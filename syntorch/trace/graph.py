"""TraceGraph: the data model every exporter reads. One networkx.DiGraph per rank with typed nodes.

Node ids are ints in traced order (0, 1, 2, ...), so two traces of the same run diff cleanly.
Attribute names are a public schema (DESIGN.md, "The TraceGraph"):

- every node: `kind` ("tensor" | "op" | "collective"), `name`
- tensor: `shape` (list), `dtype` (str), `bytes`, `is_param`, `device`, `version` (0, then +1 for every
  in-place write, so data flow through in-place ops and KV-cache writes has no cycles)
- op: `module` (e.g. "layers.3.attn.qkv", "" at the root), `phase` ("prefill", "decode[7]", "encode" (an
  encoder's one inference pass), "forward", "backward", "optimizer"), `flops`, `bytes_read`,
  `bytes_written`, `is_view`, `duration_us` (when known)
- collective: `module`, `phase`, `collective` (COLLECTIVES), `reduce_op` (sum/avg/min/max/prod or None),
  `group` (list of global ranks), `bytes` (per rank), `src`, `dst` (global ranks or None), `tag`,
  `order` (0, 1, ... among the collectives of the same group on this rank)
- edges: tensor -> op (an input) and op -> tensor (an output), `arg` = argument / output position
- graph: `model`, `rank`, `world_size`, `tp`, `pp`, `dp`, `level`, `syntorch_version`

Op -> op data dependencies (Chakra's data_deps) are derived by `op_deps()`, never stored.
"""
import contextlib
import gc
from collections.abc import Callable, Iterator, Mapping

import networkx as nx

from syntorch.version import __version__

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv", "barrier")
LEVELS = ("op", "module", "layer")
GRAPH_DEFAULTS = dict(model="", rank=0, world_size=1, tp=1, pp=1, dp=1, level="op", syntorch_version=__version__)


def collective_attrs(collective: str, *, group, nbytes: int, order: int, reduce_op: str | None = None,
                     src: int | None = None, dst: int | None = None, tag: int = 0, module: str = "",
                     phase: str = "forward", name: str = "", **attrs) -> dict:
    """A collective node's attributes, in the schema's order (TraceGraph.add_collective, level views)."""
    return dict(kind="collective", name=name or collective, module=module, phase=phase, collective=collective,
                reduce_op=reduce_op, group=[int(r) for r in group], bytes=int(nbytes), src=src, dst=dst,
                tag=int(tag), order=order, **attrs)


def op_attrs(name: str, module: str, phase: str, flops: int, bytes_read: int, bytes_written: int,
             is_view: bool) -> dict:
    """An op node's attributes, in the schema's order (TraceGraph.add_op, the tracer: positional, its hot path)."""
    return {"kind": "op", "name": name, "module": module, "phase": phase, "flops": int(flops),
            "bytes_read": int(bytes_read), "bytes_written": int(bytes_written), "is_view": is_view}


@contextlib.contextmanager
def no_gc():
    """Build graphs with the cyclic collector off: they are many small young dicts that it would rescan
    again and again for nothing (building is several times slower with it on)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:  # what the block kept goes to the oldest generation unscanned (freeze, unfreeze): the next
            # young collection would scan all of it once more (~0.1 s for a 10^5-node graph); a full pass
            # still frees the cycles among it
            gc.freeze()
            gc.unfreeze()
            gc.enable()


class TraceGraph(nx.DiGraph):
    """A networkx.DiGraph with typed nodes. Build it with add_tensor / add_op / add_collective;
    read it with the plain networkx API or the helpers below."""

    def __init__(self, incoming_graph_data=None, **attr):
        super().__init__(incoming_graph_data, **attr)
        for key, value in GRAPH_DEFAULTS.items():
            self.graph.setdefault(key, value)

    # --- fast reads ----------------------------------------------------------------------------
    # networkx's own dicts, to read and never write: its views cost microseconds per lookup, and the hot
    # paths (levels, costs, schedules, Chakra nodes) read 10^5 nodes several times.
    @property
    def node_attrs(self) -> dict[int, dict]:
        return self._node

    @property
    def preds(self) -> dict[int, dict[int, dict]]:
        """node -> {predecessor: edge attributes}"""
        return self._pred

    @property
    def succs(self) -> dict[int, dict[int, dict]]:
        """node -> {successor: edge attributes}"""
        return self._succ

    # --- building -------------------------------------------------------------------------------
    # Nodes and edges go straight into networkx's dicts: every node is new, so add_node's checks would find
    # nothing, and the tracer adds a node per tensor and op (10^5 a stage); networkx's cache is cleared as
    # its own methods would (nx._clear_cache, inline: it runs for every node).
    def add_node_data(self, data: dict, inputs=()) -> int:
        """A node with the attribute dict `data` (taken as it is), and an edge from each node of `inputs` (in
        argument order; None skips a position, and a node repeated keeps its first: x * x, one edge)."""
        if cache := getattr(self, "__networkx_cache__", None):
            cache.clear()
        node = len(self._node)  # ids are dense and in traced order; nodes are never removed
        self._node[node], self._succ[node], self._pred[node] = data, {}, {}
        pred, succ = self._pred[node], self._succ
        for arg, u in enumerate(inputs):
            if u is not None and u not in pred:
                succ[u][node] = pred[u] = {"arg": arg}
        return node

    def add_data_edge(self, u: int, v: int, arg: int) -> None:
        """add_edge(u, v, arg=arg) between nodes that exist (the tracer's hot path)."""
        data = self._succ[u].get(v)
        if data is None:
            self._succ[u][v] = self._pred[v][u] = {"arg": arg}
        else:
            data["arg"] = arg

    def append(self, nodes, edges=(), copy: bool = True) -> int:
        """Copies of `nodes` (attribute dicts, numbered on from len(self)), then of `edges` (u, v, attrs)
        into them; returns the first new id. Every edge ends at a new node, so add_edges_from's per-item
        checks would find nothing, and copies of 10^5 nodes are a hot path (replicated layers, schedules,
        level views). `copy=False`: the dicts themselves, for a caller that made them for this graph."""
        first = len(self)
        node, succ, pred = self._node, self._succ, self._pred
        for n, data in enumerate(nodes, first):
            node[n], succ[n], pred[n] = dict(data) if copy else data, {}, {}
        for u, v, data in edges:
            succ[u][v] = pred[v][u] = dict(data) if copy else data
        nx._clear_cache(self)
        return first

    def add_tensor(self, shape, dtype: str, nbytes: int, *, name: str = "", is_param: bool = False,
                   device: str = "cpu", version: int = 0, **attrs) -> int:
        node = self.add_traced_tensor(name, list(shape), dtype, int(nbytes), is_param, device, version)
        self._node[node].update(attrs)
        return node

    def add_traced_tensor(self, name: str, shape: list, dtype: str, nbytes: int, is_param: bool, device: str,
                          version: int, writer: int | None = None, arg: int = 0) -> int:
        """add_tensor's node (`shape`: a list it takes as it is), and an edge from the op `writer` that made it, at
        its output `arg` (None: none); positional, for the tracer's hot path."""
        if cache := getattr(self, "__networkx_cache__", None):
            cache.clear()
        node = len(self._node)
        self._node[node] = {"kind": "tensor", "name": name or f"t{node}", "shape": shape, "dtype": dtype,
                            "bytes": nbytes, "is_param": is_param, "device": device, "version": version}
        self._succ[node] = {}
        if writer is None:
            self._pred[node] = {}
        else:
            self._pred[node] = {writer: (edge := {"arg": arg})}
            self._succ[writer][node] = edge
        return node

    def add_op(self, name: str, inputs=(), outputs=(), *, module: str = "", phase: str = "forward",
               flops: int = 0, bytes_read: int = 0, bytes_written: int = 0, is_view: bool = False,
               **attrs) -> int:
        """inputs/outputs: tensor node ids in argument order (None skips a position)."""
        data = op_attrs(name, module, phase, flops, bytes_read, bytes_written, is_view)
        data.update(attrs)
        node = self.add_node_data(data, inputs)
        self._connect_outputs(node, outputs)
        return node

    def add_collective(self, collective: str, inputs=(), outputs=(), *, group, **fields) -> int:
        """group: the global ranks of the process group; `order` is assigned here, per group; `fields`: those
        of collective_attrs."""
        assert collective in COLLECTIVES, f"unknown collective {collective!r}"
        group = [int(r) for r in group]
        node = self.add_node_data(collective_attrs(collective, group=group, order=self._next_order(group), **fields),
                                  inputs)
        self._connect_outputs(node, outputs)
        return node

    def _connect_outputs(self, node: int, outputs):
        for arg, t in enumerate(outputs):
            if t is not None:
                self.add_data_edge(node, t, arg)

    def _next_order(self, group: list[int]) -> int:
        if "_orders" not in self.__dict__:  # rebuilt after load or copy
            self._orders = {}
            for _, c in self.collectives():
                key = tuple(c["group"])
                self._orders[key] = max(self._orders.get(key, 0), c["order"] + 1)
        key = tuple(group)
        order = self._orders.get(key, 0)
        self._orders[key] = order + 1
        return order

    # --- reading --------------------------------------------------------------------------------
    def nodes_of(self, kind: str) -> Iterator[tuple[int, dict]]:
        return ((n, d) for n, d in self._node.items() if d["kind"] == kind)

    def tensors(self) -> Iterator[tuple[int, dict]]:
        return self.nodes_of("tensor")

    def ops(self) -> Iterator[tuple[int, dict]]:
        return self.nodes_of("op")

    def collectives(self) -> Iterator[tuple[int, dict]]:
        return self.nodes_of("collective")

    def work(self) -> Iterator[tuple[int, dict]]:
        """Ops and collectives (everything a simulator runs) in traced order."""
        return ((n, d) for n, d in self._node.items() if d["kind"] != "tensor")

    def op_deps(self) -> dict[int, list[int]]:
        """For each op/collective, the ops/collectives that produced its inputs (in traced order)."""
        deps = {}
        for node, _ in self.work():
            producers = {p for t in self.predecessors(node) for p in self.predecessors(t)}
            deps[node] = sorted(producers)
        return deps

    def total_flops(self) -> int:
        return sum(d["flops"] for _, d in self.ops())


class RankTraces(Mapping):
    """rank -> TraceGraph for a multi-rank run.

    Ranks whose traces are identical share one graph: `put_shared` takes a builder that runs once, on first
    access, and every rank gets a read-only view of the same nodes with its own graph attributes (`rank`).
    Which ranks share a graph is recorded as they are put (graph_kinds reads it): costs, simulations and
    files are made once per shared graph.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._graphs: dict[int, TraceGraph] = {}
        self._pending: dict[int, tuple[list[int], Callable[[], TraceGraph]]] = {}
        self._kind: dict[int, object] = {}  # rank -> what it shares: its put_shared call's ranks, or its graph

    def put(self, rank: int, graph: TraceGraph):
        """`rank`'s own graph (ranks put with one graph object share it)."""
        self._graphs[rank] = self._kind[rank] = graph

    def put_shared(self, ranks, build: Callable[[], TraceGraph]):
        ranks = sorted(ranks)
        for r in ranks:
            self._pending[r] = (ranks, build)
            self._kind[r] = ranks

    def __getitem__(self, rank: int) -> TraceGraph:
        if rank not in self._graphs and rank in self._pending:
            ranks, build = self._pending[rank]
            shared = build()
            for r in ranks:
                self._pending.pop(r, None)
                self._graphs[r] = shared if r == ranks[0] else _rank_view(shared, r)
        return self._graphs[rank]

    def __iter__(self):
        return iter(sorted(set(self._graphs) | set(self._pending)))

    def __len__(self):
        return len(set(self._graphs) | set(self._pending))


def graph_kinds(graphs: Mapping[int, TraceGraph]) -> list[tuple[TraceGraph, list[int]]]:
    """Each distinct graph of a rank -> graph mapping once (its first rank's), with the ranks that share it,
    by first rank: as RankTraces recorded them; in a plain mapping, ranks given one graph object."""
    kind_of = graphs._kind.__getitem__ if isinstance(graphs, RankTraces) else graphs.__getitem__
    found = {}
    for r in sorted(graphs):
        found.setdefault(id(kind_of(r)), (graphs[r], []))[1].append(r)
    return list(found.values())


def with_node_attrs(graph: TraceGraph, node_attrs: dict, **attr) -> TraceGraph:
    """A graph with these node attribute dicts and `graph`'s edges, shared, not copied (read-only): a rank's
    translation of its stage representative's trace. The one place outside networkx that sets its tables."""
    out = TraceGraph(**{**graph.graph, **attr})
    out._node = node_attrs
    out._adj = out._succ = graph._succ  # networkx's DiGraph keeps _adj as _succ
    out._pred = graph._pred
    return out


def _rank_view(graph: TraceGraph, rank: int) -> TraceGraph:
    view = nx.graphviews.generic_graph_view(graph)
    view.graph = {**graph.graph, "rank": rank}
    return view
