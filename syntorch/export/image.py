"""PNG/SVG drawings of a TraceGraph: tensors green, ops blue, collectives red (seed 000).

Layered top to bottom, one column per phase: `networkx.topological_generations` gives each node its row,
then every node moves down to just above its first reader (parameters and their transposes sit beside the
matmul that reads them, not all in the first row); each row is ordered by where its inputs sit. Graphs too
big to read at op level are drawn at module or layer level; the title says which level and how many
nodes. matplotlib with the Agg backend, no graphviz.
"""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import networkx as nx  # noqa: E402

from syntorch.outdir import atomic_output_file  # noqa: E402
from syntorch.trace.graph import LEVELS, TraceGraph  # noqa: E402
from syntorch.trace.levels import level_view  # noqa: E402

COLORS = {"tensor": "#4caf50", "op": "#1e88e5", "collective": "#e53935"}
READABLE_NODES = 400  # above this an op-level drawing is a grey smear: go a level coarser
MAX_INCHES = 300  # matplotlib's Agg canvas must stay under 2**16 pixels a side
MAX_PIXELS = 16000  # a side, and drawing time grows with the canvas: tall graphs get a lower dpi
LABEL_NODES = 250  # label every op when there are at most this many nodes, else only ops with FLOPs


def choose_level(graph: TraceGraph, level: str | None) -> TraceGraph:
    """`level` if given, else the finest level with at most READABLE_NODES nodes (layer at worst)."""
    if level:
        return level_view(graph, level)
    for candidate in LEVELS:
        view = level_view(graph, candidate)
        if len(view) <= READABLE_NODES:
            return view
    return view


def layered_positions(graph: nx.DiGraph) -> dict:
    """One column per phase (prefill, decode[0], ...) left to right, rows top to bottom inside each: the
    steps of a generation are linked only through the KV cache, so one layering would smear them together."""
    columns: dict[str, list] = {}
    for node, phase in _phases(graph).items():
        columns.setdefault(phase, []).append(node)
    pos, left = {}, 0.0
    for nodes in columns.values():
        placed = _place_rows(graph.subgraph(nodes), left)
        pos.update(placed)
        left = max(x for x, _ in placed.values()) + 2
    return pos


def _phases(graph: nx.DiGraph) -> dict:
    """Each node's phase; a tensor takes its producer's, or its first reader's if nothing produced it."""
    phase = {}
    for node in nx.topological_sort(graph):
        d = graph.nodes[node]
        if d["kind"] != "tensor":
            phase[node] = d["phase"]
    for node, d in graph.nodes(data=True):
        if d["kind"] == "tensor":
            near = list(graph.predecessors(node)) or list(graph.successors(node))
            phase[node] = phase[min(near)] if near else ""
    return dict(sorted(phase.items()))  # columns in traced order


def _place_rows(graph: nx.DiGraph, left: float) -> dict:
    row = {n: i for i, generation in enumerate(nx.topological_generations(graph)) for n in generation}
    for node in reversed(list(nx.topological_sort(graph))):  # as late as possible: beside its first reader
        readers = list(graph.successors(node))
        if readers:
            row[node] = min(row[r] for r in readers) - 1
    rows: dict[int, list] = {}
    for node in sorted(graph):
        rows.setdefault(row[node], []).append(node)
    width = max(len(r) for r in rows.values())
    pos = {}
    for y in sorted(rows):
        # order a row by where its inputs sit (fewer crossings); nodes without placed inputs keep traced order
        def x_of_inputs(n):
            xs = [pos[p][0] for p in graph.predecessors(n) if p in pos]
            return sum(xs) / len(xs) if xs else left + width / 2
        nodes = sorted(rows[y], key=x_of_inputs)
        start = left + (width - len(nodes)) / 2
        pos.update({n: (start + i, -y) for i, n in enumerate(nodes)})
    return pos


def _label(d: dict) -> str:
    if d["kind"] == "collective":
        return f"{d['collective']} {d['group']}"
    if d["kind"] == "tensor":
        return d["name"] if d["is_param"] else "x".join(map(str, d["shape"]))
    return d["name"].removeprefix("aten.")


def _phase_headers(graph: nx.DiGraph, pos: dict, ax):
    """The phase's name above each column."""
    columns: dict[str, list] = {}
    for node, phase in _phases(graph).items():
        columns.setdefault(phase, []).append(pos[node][0])
    for phase, xs in columns.items():
        ax.text(sum(xs) / len(xs), 1.2, phase, ha="center", va="bottom", fontsize=11, fontweight="bold")


def draw(graph: TraceGraph, path, level: str | None = None, comm: bool = False, fmt: str | None = None) -> TraceGraph:
    """Draw `graph` to `path` (png or svg by suffix or `fmt`); `comm` emphasises collectives and their edges.
    Returns the graph at the level drawn."""
    view = choose_level(graph, level)
    pos = layered_positions(nx.DiGraph(view))
    width = max((x for x, _ in pos.values()), default=0) + 3  # labels run right of the last column
    depth = -min((y for _, y in pos.values()), default=0) + 1
    size = (min(max(10.0, width * 1.1), MAX_INCHES), min(max(6.0, depth * 0.3), MAX_INCHES))
    fig, ax = plt.subplots(figsize=size)
    _draw_edges(view, pos, ax, comm)
    _draw_nodes(view, pos, ax, comm)
    _phase_headers(view, pos, ax)
    g = view.graph
    n_coll = sum(1 for _ in view.collectives())
    ax.set_title(f"{g.get('model') or 'trace'}, rank {g.get('rank', 0)} of {g.get('world_size', 1)}: "
                 f"{g['level']} level, {len(view)} nodes ({n_coll} collectives)\n"
                 "green: tensors, blue: ops, red: collectives", fontsize=12)
    ax.axis("off")
    ax.margins(0.02, 0.2 / size[1])  # matplotlib's default 5% is inches of blank on a tall graph
    ax.set_xlim(right=width - 1)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=1 - 0.8 / size[1])  # tight_layout costs a draw
    dpi = min(100, int(MAX_PIXELS / max(size)))
    with atomic_output_file(path) as tmp, plt.rc_context({"svg.fonttype": "none"}):  # SVG text stays text
        fig.savefig(tmp, format=fmt or str(path).rsplit(".", 1)[-1], dpi=dpi)
    plt.close(fig)
    return view


def _draw_edges(view, pos, ax, comm: bool):
    comm_edges = [(u, v) for u, v in view.edges if "collective" in (view.nodes[u]["kind"], view.nodes[v]["kind"])]
    data_edges = [e for e in view.edges if e not in set(comm_edges)]
    # arrow heads are one patch each (slow: minutes for thousands); rows already say which way data flows
    heads = dict(arrowsize=8, node_size=80) if len(view) <= LABEL_NODES else dict(arrows=False)
    nx.draw_networkx_edges(view, pos, edgelist=data_edges, ax=ax, edge_color="black", width=0.6,
                           alpha=0.25 if comm else 0.7, **heads)
    nx.draw_networkx_edges(view, pos, edgelist=comm_edges, ax=ax, edge_color="red", width=2.0 if comm else 1.2,
                           **heads)


def _draw_nodes(view, pos, ax, comm: bool):
    big = len(view) > LABEL_NODES
    for kind, color in COLORS.items():
        nodes = [n for n, d in view.nodes(data=True) if d["kind"] == kind]
        size = {"tensor": 25, "op": 80, "collective": 260 if comm else 150}[kind]
        fade = 0.35 if comm and kind != "collective" else 0.95
        nx.draw_networkx_nodes(view, pos, nodelist=nodes, node_color=color, node_size=size, alpha=fade, ax=ax,
                               node_shape="o" if kind == "tensor" else "s")
    for kind, font, color in (("tensor", 6, "#2e7d32"), ("op", 8, "#0d47a1"), ("collective", 9, "#b71c1c")):
        labels = {n: "   " + _label(d) for n, d in view.nodes(data=True) if d["kind"] == kind
                  and (not big or kind == "collective" or (kind == "op" and d["flops"]))}
        nx.draw_networkx_labels(view, pos, labels, font_size=font, font_color=color, ax=ax,
                                horizontalalignment="left")


def export_png(graph: TraceGraph, path, level: str | None = None) -> None:
    draw(graph, path, level, fmt="png")


def export_svg(graph: TraceGraph, path, level: str | None = None) -> None:
    draw(graph, path, level, fmt="svg")
