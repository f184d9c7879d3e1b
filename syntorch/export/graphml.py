"""GraphML for other graph tools (yEd, Gephi, Cytoscape), round-tripping through networkx.read_graphml.

GraphML holds only scalars, one type per attribute key. Attributes that are lists or may be None
(`shape`, `group`, `src`, `dst`, `reduce_op`, ...) are written as JSON text for every node, and the graph
attribute `json_attributes` names them so `load` turns them back into lists and None.
"""
import json

import networkx as nx

from syntorch.outdir import atomic_output_file
from syntorch.trace.graph import TraceGraph

SCALARS = (bool, int, float, str)


def _json_keys(items) -> list[str]:
    return sorted({k for attrs in items for k, v in attrs.items() if not isinstance(v, SCALARS)})


def _encoded(attrs: dict, keys) -> dict:
    return {k: json.dumps(v) if k in keys else v for k, v in attrs.items()}


def export(graph: TraceGraph, path, level: str | None = None) -> None:
    from syntorch.trace.levels import level_view
    graph = level_view(graph, level) if level else graph
    node_keys = _json_keys(d for _, d in graph.nodes(data=True))
    edge_keys = _json_keys(d for _, _, d in graph.edges(data=True))
    out = nx.DiGraph()
    out.graph.update(_encoded(graph.graph, _json_keys([graph.graph])))
    out.graph["json_attributes"] = json.dumps({"node": node_keys, "edge": edge_keys,
                                               "graph": _json_keys([graph.graph])})
    out.add_nodes_from((n, _encoded(d, node_keys)) for n, d in graph.nodes(data=True))
    out.add_edges_from((u, v, _encoded(d, edge_keys)) for u, v, d in graph.edges(data=True))
    with atomic_output_file(path) as tmp:
        nx.write_graphml(out, tmp)


def load(path) -> TraceGraph:
    graph = nx.read_graphml(path, node_type=int)
    for default in ("node_default", "edge_default"):  # added by read_graphml
        graph.graph.pop(default, None)
    keys = json.loads(graph.graph.pop("json_attributes", '{"node": [], "edge": [], "graph": []}'))
    decode = (lambda attrs, names: attrs.update({k: json.loads(attrs[k]) for k in names if k in attrs}))
    decode(graph.graph, keys["graph"])
    for _, d in graph.nodes(data=True):
        decode(d, keys["node"])
    for _, _, d in graph.edges(data=True):
        decode(d, keys["edge"])
    return TraceGraph(graph)
