"""TraceGraph's building and RankTraces' sharing, against networkx and against what was put."""
import networkx as nx
import torch

from conftest import tiny_config
from syntorch.models import build_model
from syntorch.trace import Tracer, cost
from syntorch.trace.graph import RankTraces, TraceGraph, graph_kinds, with_node_attrs


def traced() -> TraceGraph:
    model = build_model(tiny_config("gpt2"), device="meta")
    with Tracer(model) as tracer:
        model(torch.zeros(1, 5, dtype=torch.long, device="meta")).sum().backward()
    return tracer.graph


def test_built_graph_equals_networkx_built_the_same_way():
    """The tracer writes nodes and edges into the graph's dicts itself: the same nodes, edges and attribute
    order as networkx's add_node / add_edge in traced order make (node by node, each node's in-edges in
    argument order)."""
    graph = traced()
    reference = nx.DiGraph(**graph.graph)
    for n, d in graph.node_attrs.items():
        reference.add_node(n, **d)
        for u, e in graph.preds[n].items():
            reference.add_edge(u, n, **e)
    assert list(graph.nodes(data=True)) == list(reference.nodes(data=True))
    assert [list(d.items()) for _, d in graph.nodes(data=True)] == [list(d.items()) for _, d in reference.nodes(data=True)]
    for n in graph:
        assert list(graph.succ[n].items()) == list(reference.succ[n].items())
        assert list(graph.pred[n].items()) == list(reference.pred[n].items())


def test_ranks_share_a_graph_as_they_were_put():
    """Sharing is what was put, not which node dicts graphs happen to hold: a rank's graph that shares every
    node dict with another's (a translation, trace/generation.translated) is a kind of its own."""
    graph = traced()
    traces = RankTraces(6)
    traces.put_shared(range(4), lambda: graph)
    traces.put(4, with_node_attrs(graph, dict(graph.node_attrs), rank=4))
    traces.put(5, graph)
    kinds = graph_kinds(traces)
    assert [ranks for _, ranks in kinds] == [[0, 1, 2, 3], [4], [5]]
    assert kinds[0][0] is traces[0] and traces[1].graph["rank"] == 1
    assert [ranks for _, ranks in graph_kinds({0: graph, 1: graph, 2: traced()})] == [[0, 1], [2]]


def test_durations_are_filled_once_per_shared_graph(monkeypatch):
    graph = traced()
    traces = RankTraces(3)
    traces.put_shared(range(2), lambda: graph)
    traces.put(2, with_node_attrs(graph, dict(graph.node_attrs), rank=2))
    filled = []
    monkeypatch.setattr(cost, "fill_durations", lambda g, *args: filled.append(g))
    cost.fill_rank_durations(traces, None)
    assert filled == [traces[0], traces[2]]
