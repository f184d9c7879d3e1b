"""What graph-equality tests compare of TraceGraphs, shared by the trace tests."""


def edges(graph) -> tuple:
    """Every edge with its attributes, in both of networkx's orders (level views and Chakra nodes read both)."""
    return ([(u, list(vs.items())) for u, vs in graph.succs.items()],
            [(v, list(us.items())) for v, us in graph.preds.items()])
