"""PNG/SVG drawings of a TraceGraph: tensors green, ops blue, collectives red (seed 000).

Identical consecutive layers are drawn once, in a grey box labelled with the layers it stands for and
"× N": folds.fold_repeated_layers decides from the graph itself (ops, shapes, FLOPs, collectives), so a
layer that differs is drawn on its own; a pipeline stage's micro-batches each get their own box. Identical
consecutive decode steps are drawn as one column, `decode[0–18] × 19, KV length 11–29`
(folds.fold_repeated_steps: the same graph but for shapes that grow by one a step), growing tensors
labelled `1x12x11–29x64`; prefill stays its own column. The title gives the collectives and FLOPs of the
whole trace, every layer and step. Folding is for drawing only; the traced graph and its JSON keep every
layer and step. The folded graph is drawn at the finest level with at most READABLE_NODES nodes (the title
says which level).

Layered top to bottom, one column per phase: `networkx.topological_generations` gives each node its row,
then every node moves down to just above its first reader (parameters and their transposes sit beside the
matmul that reads them, not all in the first row); each row is ordered by where its inputs sit. Columns
wrap into bands so that many phases (decode steps) still make a page-shaped image.

matplotlib's Figure with the Agg backend, no pyplot and no graphviz. A drawing costs about its number of
text labels (each is laid out by FreeType, ~1-3 ms), so every node kind is one artist, all edges are
one, and big graphs label only what carries the story.
"""
from collections import Counter

import matplotlib
import networkx as nx
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from syntorch.outdir import atomic_output_file
from syntorch.trace.folds import fold_repeated_layers, fold_repeated_steps, layer_blocks
from syntorch.trace.graph import LEVELS, TraceGraph, no_gc
from syntorch.trace.levels import level_view

COLORS = {"tensor": "#4caf50", "op": "#1e88e5", "collective": "#e53935"}
READABLE_NODES = 400  # above this an op-level drawing is a grey smear: go a level coarser
LABEL_NODES = 150  # label tensors too when there are at most this many nodes
LABEL_WORK = 200  # label every op when there are at most this many ops and collectives, else those with FLOPs
INCH_X, INCH_Y = 0.45, 0.26  # inches per node step across and per row down: room for 7-8 pt labels
CHAR_STEPS = 0.058 / INCH_X  # node steps per label character (7-8 pt DejaVu Sans), to leave room for labels
TITLE_STEPS = 0.075 / INCH_X  # the same for a box's title (9 pt bold)
HEADER_STEPS = 0.085 / INCH_X  # the same for a column's header (10 pt bold)
TITLE_INCHES_PER_CHAR = 0.075  # the image's title (10 pt), which sets the least width
PAGE_ASPECT = 1.4  # width / height the bands of columns aim for
MAX_INCHES = 300  # matplotlib's Agg canvas must stay under 2**16 pixels a side
MAX_PIXELS = 16000  # a side, and drawing time grows with the canvas: huge graphs get a lower dpi


def choose_level(graph: TraceGraph, level: str | None) -> TraceGraph:
    """`level` if given, else the finest level with at most READABLE_NODES nodes (layer at worst)."""
    if level:
        return level_view(graph, level)
    for candidate in LEVELS:
        view = level_view(graph, candidate)
        if len(view) <= READABLE_NODES:
            return view
    return view


def layered_positions(graph: nx.DiGraph, reach: dict | None = None, boxes=(), headers: dict | None = None) -> dict:
    """One column per phase (prefill, decode[0], ...), rows top to bottom inside each: the steps of a
    generation are linked only through the KV cache, so one layering would smear them together. Columns
    run left to right in bands, as many bands as bring the whole closest to a page's shape. `reach`: how
    far right of a node its label runs (in node steps), so labels do not run into their neighbours;
    `boxes`: (nodes, width of a title in node steps): each box gets an empty row above it for its title;
    `headers`: {phase: width of its column's header in node steps} for headers wider than a phase's name."""
    reach = reach or {}
    columns: dict[str, list] = {}
    for node, phase in _phases(graph).items():
        columns.setdefault(phase, []).append(node)
    placed = [_open_rows(_place_rows(graph.subgraph(nodes), reach), boxes) for nodes in columns.values()]
    widths = [max(_right_edges(p, reach, boxes)) + 1.5 for p in placed]
    for i, phase in enumerate(columns):  # a wide header: its column widens, its nodes stay in the middle
        shift = ((headers or {}).get(phase, 0) + 1.0 - widths[i]) / 2
        if shift > 0:
            placed[i] = {n: (x + shift, y) for n, (x, y) in placed[i].items()}
            widths[i] += 2 * shift
    depth = max((-min(y for _, y in p.values()) for p in placed), default=0) + 2  # header and gap rows
    per_band = min(range(1, len(placed) + 1), default=1,
                   key=lambda n: abs(_band_aspect(widths, depth, n) - PAGE_ASPECT))
    pos, left = {}, 0.0
    for i, p in enumerate(placed):
        if i % per_band == 0:
            left = 0.0
        top = -(i // per_band) * depth
        pos.update({n: (left + x, top + y) for n, (x, y) in p.items()})
        left += widths[i]
    return pos


def _right_edges(pos: dict, reach: dict, boxes):
    """Where each label and box title in `pos` ends (a box title starts at the box's left edge)."""
    yield from (x + reach.get(n, 0) for n, (x, _) in pos.items())
    for nodes, title in boxes:
        xs = [pos[n][0] for n in nodes if n in pos]
        if xs:
            yield min(xs) - 0.35 + title


def _open_rows(pos: dict, boxes) -> dict:
    """Moves everything from each box's first row on down one row: that row is left for the box's title."""
    for box, _ in boxes:
        tops = [pos[n][1] for n in box if n in pos]
        if tops:
            top = max(tops)
            pos = {n: (x, y - 1 if y <= top else y) for n, (x, y) in pos.items()}
    return pos


def _band_aspect(widths: list, depth: float, per_band: int) -> float:
    bands = [sum(widths[i:i + per_band]) for i in range(0, len(widths), per_band)]
    return max(bands) * INCH_X / (len(bands) * depth * INCH_Y)


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


def _place_rows(graph: nx.DiGraph, reach: dict) -> dict:
    """Positions from x = 0 and y = 0 (the first row) down; a labelled node leaves room for its label."""
    row = {n: i for i, generation in enumerate(nx.topological_generations(graph)) for n in generation}
    for node in reversed(list(nx.topological_sort(graph))):  # as late as possible: beside its first reader
        readers = list(graph.successors(node))
        if readers:
            row[node] = min(row[r] for r in readers) - 1
    rows: dict[int, list] = {}
    for node in sorted(graph):
        rows.setdefault(row[node], []).append(node)
    steps = {n: max(1.0, reach.get(n, 0) + 0.3) for n in graph}
    width = max(sum(steps[n] for n in r[:-1]) for r in rows.values())
    pos = {}
    for y in sorted(rows):
        # order a row by where its inputs sit (fewer crossings); nodes without placed inputs keep traced order
        def x_of_inputs(n):
            xs = [pos[p][0] for p in graph.predecessors(n) if p in pos]
            return sum(xs) / len(xs) if xs else width / 2
        nodes = sorted(rows[y], key=x_of_inputs)
        x = (width - sum(steps[n] for n in nodes[:-1])) / 2
        for n in nodes:
            pos[n] = (x, -y)
            x += steps[n]
    return pos


def fold(graph: TraceGraph) -> tuple[TraceGraph, dict, dict]:
    """(graph folded, layers' repeats, decode steps' runs): fold_repeated_layers then fold_repeated_steps,
    what every drawing of `graph` starts from (compute it once for several)."""
    with no_gc():  # folding copies 10^4 small dicts; the collector would rescan the whole graph for nothing
        folded, repeats = fold_repeated_layers(graph)
        folded, runs = fold_repeated_steps(folded, repeats)
    return folded, repeats, runs


def draw(graph: TraceGraph, path, level: str | None = None, comm: bool = False, fmt: str | None = None,
         folded: tuple[TraceGraph, dict, dict] | None = None) -> TraceGraph:
    """Draw `graph` to `path` (png or svg by suffix or `fmt`); `comm` emphasises collectives and their edges.
    `folded` is fold(graph) when the caller has it. Returns the graph at the level drawn (repeated layers
    and decode steps folded)."""
    folded, repeats, runs = folded or fold(graph)
    headers = {phase: run.title for phase, run in runs.items()}
    with no_gc():
        view = choose_level(folded, level)
    spans = _spans(view, repeats)
    labels = _labels(view, comm, spans)
    reach = {n: 0.3 + len(text) * CHAR_STEPS for n, text in labels.items()}
    boxes = _boxes(spans)
    pos = layered_positions(nx.DiGraph(view), reach, [(nodes, len(t) * TITLE_STEPS) for t, nodes in boxes],
                            {phase: len(text) * HEADER_STEPS for phase, text in headers.items()})
    title = _title(view, graph, bool(repeats), bool(runs))
    fig, ax, dpi = _canvas(pos, reach, min_width=max(map(len, title.splitlines())) * TITLE_INCHES_PER_CHAR)
    _draw_boxes(pos, boxes, reach, ax)
    _draw_edges(view, pos, ax, comm)
    _draw_nodes(view, pos, ax, comm)
    _draw_labels(view, pos, labels, ax)
    _phase_headers(view, pos, ax, headers)
    fig.suptitle(title, fontsize=10, y=1 - 0.1 / fig.get_figheight())
    _save(fig, path, fmt or str(path).rsplit(".", 1)[-1], dpi)
    return view


def _save(fig, path, fmt: str, dpi: int):
    # zlib's fastest level: half the encoding time of the default, ~10% bigger files of mostly white
    fast = {"pil_kwargs": {"compress_level": 1}} if fmt == "png" else {}
    # SVG text stays text; unhinted glyphs render ~1/3 faster, and text is most of a drawing's time
    rc = {"svg.fonttype": "none", "text.hinting": "no_hinting"}
    with atomic_output_file(path) as tmp, matplotlib.rc_context(rc):
        fig.savefig(tmp, format=fmt, dpi=dpi, **fast)


def _canvas(pos: dict, reach: dict, min_width: float):
    """A figure sized from the layout: INCH_X per step across, INCH_Y per row, at least `min_width` inches
    wide (the title), with fixed margins in inches (0.8 on top for the title), and axes limits set here, so
    no autoscaled blank bands."""
    xs, ys = [x for x, _ in pos.values()] or [0], [y for _, y in pos.values()] or [0]
    x0, x1 = min(xs) - 0.8, max((x + reach.get(n, 0) for n, (x, _) in pos.items()), default=0) + 0.5
    y0, y1 = min(ys) - 0.8, max(ys) + 1.6  # room for the phase headers
    pad = max(0.0, (min_width - 0.4) / INCH_X - (x1 - x0)) / 2  # a narrow drawing stays centred, to scale
    x0, x1 = x0 - pad, x1 + pad
    width = min((x1 - x0) * INCH_X + 0.4, MAX_INCHES)
    height = min((y1 - y0) * INCH_Y + 1.0, MAX_INCHES)
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes((0.2 / width, 0.2 / height, 1 - 0.4 / width, 1 - 1.0 / height))
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.axis("off")
    return fig, ax, min(100, int(MAX_PIXELS / max(width, height)))


def _spans(view, repeats: dict) -> dict:
    """{node: (layer, span, count, box)} for the nodes of each kept copy of repeated layers, e.g.
    ("layers.1", "layers.1–95", 95, 7); box: the copy's block index, as a pipeline stage keeps one copy per
    micro-batch, all of them layers.0 in phase forward."""
    spans, seen = {}, Counter()
    for box, (phase, layer, nodes) in enumerate(layer_blocks(view)):  # the folded graph's blocks, one for one
        stands_for = repeats.get((phase, layer, seen[phase, layer]))
        seen[phase, layer] += 1
        if stands_for:  # backward runs layers.95 down to layers.0: name the span low to high all the same
            ends = sorted(stands_for, key=lambda name: int(name.rsplit(".", 1)[1]))
            span = f"{ends[0]}–{ends[-1].rsplit('.', 1)[1]}"
            spans.update(dict.fromkeys(nodes, (layer, span, len(stands_for), box)))
    return spans


def _boxes(spans: dict) -> list[tuple[str, list]]:
    """(title, nodes) of each box: one per kept copy of repeated layers."""
    boxes: dict[int, tuple] = {}
    for n, (_, span, count, box) in spans.items():
        boxes.setdefault(box, (f"{span} × {count}", []))[1].append(n)
    return list(boxes.values())


def _draw_boxes(pos, boxes: dict, reach: dict, ax):
    """A grey box around each kept copy of repeated layers and its labels, titled `layers.1–95 × 95` in the
    empty row the layout left above it."""
    for title, nodes in boxes:
        xs, ys = [pos[n][0] for n in nodes], [pos[n][1] for n in nodes]
        left, top, bottom = min(xs) - 0.5, max(ys) + 1.5, min(ys) - 0.5
        right = max(max(pos[n][0] + reach.get(n, 0) for n in nodes), left + 0.15 + len(title) * TITLE_STEPS)
        ax.add_patch(Rectangle((left, bottom), right + 0.3 - left, top - bottom, facecolor="#f2f2f2",
                               edgecolor="#757575", linestyle="--", linewidth=1, zorder=0))
        ax.text(left + 0.15, top - 0.5, title, ha="left", va="center", fontsize=9, fontweight="bold",
                color="#424242", zorder=4, bbox=dict(facecolor="#f2f2f2", edgecolor="none", pad=1))


def _draw_edges(view, pos, ax, comm: bool):
    """All edges as line collections (one artist each); rows already say which way data flows."""
    kinds = view.nodes
    lines = {False: [], True: []}
    for u, v in view.edges:
        lines["collective" in (kinds[u]["kind"], kinds[v]["kind"])].append((pos[u], pos[v]))
    ax.add_collection(LineCollection(lines[False], colors="black", linewidths=0.6, alpha=0.25 if comm else 0.6,
                                     zorder=1))
    ax.add_collection(LineCollection(lines[True], colors="red", linewidths=2.0 if comm else 1.2, zorder=1))


def _draw_nodes(view, pos, ax, comm: bool):
    for kind, color in COLORS.items():
        xy = [pos[n] for n, d in view.nodes(data=True) if d["kind"] == kind]
        if not xy:
            continue
        size = {"tensor": 25, "op": 80, "collective": 260 if comm else 150}[kind]
        fade = 0.35 if comm and kind != "collective" else 0.95
        ax.scatter(*zip(*xy), s=size, c=color, alpha=fade, marker="o" if kind == "tensor" else "s",
                   linewidths=0, zorder=2)


def _labels(view, comm: bool, spans: dict) -> dict:
    """{node: text} for the nodes to label: collectives always; the comm image nothing else (its point);
    otherwise every op (or, past LABEL_WORK ops, those with FLOPs) and, in small graphs, tensors' shapes
    and parameters' names. Text is what makes a drawing slow."""
    work, total = sum(1 for _ in view.work()), len(view)

    def wanted(d):
        if d["kind"] == "collective" or comm:
            return d["kind"] == "collective"
        return (work <= LABEL_WORK or d["flops"] > 0) if d["kind"] == "op" else total <= LABEL_NODES

    return {n: _label(d, *spans.get(n, ("", ""))[:2], comm=comm) for n, d in view.nodes(data=True) if wanted(d)}


def _draw_labels(view, pos, labels: dict, ax):
    """Right of each node; inside a box the box's own layer is left out of names."""
    style = {"tensor": (6, "#2e7d32"), "op": (7, "#0d47a1"), "collective": (8, "#b71c1c")}
    for n, text in labels.items():
        font, color = style[view.nodes[n]["kind"]]
        ax.text(pos[n][0] + 0.25, pos[n][1], text, fontsize=font, color=color, ha="left", va="center", zorder=3)


def _label(d: dict, layer: str = "", span: str = "", comm: bool = False) -> str:
    """What a node is; inside a layer box names drop the layer (`attn.qkv`), and the layer itself
    (layer level) is named by its span (`layers.0–95`). The comm image names a collective's module and
    size too, as it has no op labels around it."""
    if d["kind"] == "collective":
        where = f" {_unlayered(d['module'], layer, span)} {_size(d['bytes'])}" if comm else ""
        return f"{d['collective']} {_ranks(d['group'])}{where}"
    if d["kind"] == "tensor" and not d["is_param"]:  # over folded decode steps: 1x2x5–23x16
        last = d.get("last_shape", d["shape"])
        return "x".join(str(a) if a == b else f"{a}–{b}" for a, b in zip(d["shape"], last))
    return _unlayered(d["name"].removeprefix("aten."), layer, span)


def _unlayered(name: str, layer: str, span: str) -> str:
    if layer and name == layer:
        return span
    return name.removeprefix(f"{layer}.") if layer else name


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.3g} {unit}"
        nbytes /= 1024
    return f"{nbytes:.3g} GiB"


def _ranks(group: list) -> str:
    """[0, 1, 2, 3] -> [0–3]; groups that are not one run stay lists."""
    if len(group) > 2 and group == list(range(group[0], group[-1] + 1)):
        return f"[{group[0]}–{group[-1]}]"
    return str(group)


def _phase_headers(view, pos, ax, headers: dict):
    """The phase's name above each column (`headers`: the title of a column of folded decode steps)."""
    columns: dict[str, list] = {}
    for node, phase in _phases(view).items():
        columns.setdefault(phase, []).append(pos[node])
    for phase, xy in columns.items():
        x = sum(x for x, _ in xy) / len(xy)
        ax.text(x, max(y for _, y in xy) + 0.8, headers.get(phase, phase), ha="center", va="bottom", fontsize=10, fontweight="bold")


def _title(view, graph: TraceGraph, layers: bool, steps: bool) -> str:
    """What is drawn, and the totals of the whole trace: folding draws fewer collectives than ran."""
    g = view.graph
    drawn, traced = sum(1 for _ in view.collectives()), sum(1 for _ in graph.collectives())
    boxes = "; grey boxes: identical consecutive layers drawn once" if layers else ""
    columns = "; decode[a–b] × n: identical decode steps drawn once" if steps else ""
    return (f"{g.get('model') or 'trace'}, rank {g.get('rank', 0)} of {g.get('world_size', 1)}: {g['level']} level, "
            f"{len(view)} nodes drawn ({drawn} collectives) of {len(graph)} traced "
            f"({traced} collectives, {_flops(graph.total_flops())} in all)\n"
            f"green: tensors, blue: ops, red: collectives{boxes}{columns}")


def _flops(flops: float) -> str:
    for unit in ("", "k", "M", "G", "T"):
        if flops < 1000:
            break
        flops /= 1000
    return f"{flops:.3g} {unit}FLOP"


def export_png(graph: TraceGraph, path, level: str | None = None) -> None:
    draw(graph, path, level, fmt="png")


def export_svg(graph: TraceGraph, path, level: str | None = None) -> None:
    draw(graph, path, level, fmt="svg")
