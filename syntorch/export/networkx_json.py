"""NetworkX node-link JSON: the graph as users script against it (`tensor_trace_graph.json`)."""
import itertools
import json
from pathlib import Path

import networkx as nx

from syntorch.errors import UserError
from syntorch.userfiles import read_json
from syntorch.outdir import atomic_output_file
from syntorch.trace.graph import TraceGraph

KINDS = {"tensor", "op", "collective"}
BATCH = 2000  # nodes or edges encoded at once


def export(graph: TraceGraph, path, level: str | None = None) -> None:
    """Write `graph` (at `level`, if given) as node-link JSON, what json.dumps(nx.node_link_data(graph,
    edges="edges"), separators=(",", ":")) gives ({"directed": ..., "graph": {...}, "nodes": [...],
    "edges": [...]}), encoded a batch at a time: with the C encoder (json.dump runs the pure-Python one,
    ~5x slower), but without one string of the whole file (tens of MB, a page fault every 4 KB of it)."""
    from syntorch.trace.levels import level_view
    graph = level_view(graph, level) if level else graph
    encode = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode  # attributes hold no cycles
    nodes = ({**d, "id": n} for n, d in graph.node_attrs.items())
    edges = ({**d, "source": u, "target": v} for u, targets in graph.succs.items() for v, d in targets.items())
    with atomic_output_file(path) as tmp, open(tmp, "w") as f:
        f.write('{"directed":true,"multigraph":false,"graph":' + encode(graph.graph))
        for key, items in (("nodes", nodes), ("edges", edges)):
            f.write(f',"{key}":[')
            for i, batch in enumerate(iter(lambda: list(itertools.islice(items, BATCH)), [])):
                f.write(("," if i else "") + encode(batch)[1:-1])  # the items, without the list's brackets
            f.write("]")
        f.write("}")


def load(path) -> TraceGraph:
    """A TraceGraph from a file `export` wrote; a clear UserError for anything else."""
    return from_node_link(read_json(path, "graph file (a tensor_trace_graph.json written by syntorch)"), Path(path))


def from_node_link(data, source="input") -> TraceGraph:
    if not (isinstance(data, dict) and isinstance(data.get("nodes"), list)
            and isinstance(data.get("edges", data.get("links")), list)):
        raise UserError(f"{source} is not a syntorch trace graph (no node-link 'nodes' and 'edges')")
    bad = next((n for n in data["nodes"] if not isinstance(n, dict) or n.get("kind") not in KINDS
                or "id" not in n or "name" not in n), None)
    if bad is not None:
        raise UserError(f"{source} is not a syntorch trace graph: node {str(bad)[:80]} lacks id, name "
                        f"or a kind in {sorted(KINDS)}")
    edges = "edges" if "edges" in data else "links"
    ids = {n["id"] for n in data["nodes"] if isinstance(n["id"], (int, str))}
    dangling = next((e for e in data[edges] if not isinstance(e, dict) or e.get("source") not in ids
                     or e.get("target") not in ids), None)
    if dangling is not None:  # networkx would add the missing end as a node without a kind
        raise UserError(f"{source} is not a valid trace graph: edge {str(dangling)[:80]} names a node it does not have")
    try:
        graph = nx.node_link_graph({**data, "directed": True, "multigraph": False}, edges=edges)
    except (KeyError, TypeError, nx.NetworkXError) as e:
        raise UserError(f"{source} is not a valid node-link graph: {e}") from None
    return TraceGraph(graph)
