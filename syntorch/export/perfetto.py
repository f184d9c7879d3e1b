"""A trace graph as a Chrome trace event JSON timeline (loads in ui.perfetto.dev and chrome://tracing): the
graph's ops and collectives run through the simulator every prediction uses (syntorch/simulate), so the
timeline is the predicted one: one process per rank kind, one track per stream (compute, each
communicator), a slice per op and collective with its FLOPs, bytes and group.

Durations are the graph's (from the cost model, trace/cost.py, when it was traced with --hw_config), or the
cost model's for `hw_config` (set on the graph). A single graph stands for every rank of its world (TP ranks run the same
graph); a rank -> graph mapping (RankTraces) is simulated as given.
"""
from collections.abc import Mapping

from syntorch.errors import UserError
from syntorch.hardware import load_hw_config
from syntorch.simulate.engine import simulate
from syntorch.simulate.prediction import rank_programs
from syntorch.simulate.timeline import timeline_events, write_events
from syntorch.trace.cost import check_attention, check_profile, fill_rank_durations
from syntorch.trace.graph import graph_kinds

ARGS = ("module", "phase", "flops", "bytes_read", "bytes_written", "collective", "reduce_op", "group",
        "bytes", "src", "dst", "tag", "order", "num_ops")


def trace_events(graphs, hw_config: str | None = None, profile: str = "eager", attention: str = "flash") -> dict:
    """`graphs`: one TraceGraph or a rank -> TraceGraph mapping (RankTraces)."""
    by_rank = _ranks(graphs)
    if hw_config is not None:
        fill_rank_durations(by_rank, load_hw_config(hw_config), check_profile(profile), check_attention(attention))
    elif any(d.get("duration_us") is None for g in by_rank.values() for _, d in g.work()):
        raise UserError("the graph has no durations (traced without --hw_config); give --hw_config for the "
                        "performance model's")
    programs, tasks = rank_programs(by_rank)
    run = simulate(programs)
    args = [[{k: graph.node_attrs[n][k] for k in ARGS if graph.node_attrs[n].get(k) is not None} for n in nodes]
            for graph, nodes in tasks]
    return {"traceEvents": timeline_events(run, args), "displayTimeUnit": "ms"}


def _ranks(graphs) -> dict:
    if isinstance(graphs, Mapping):
        return graphs  # as it is: a RankTraces knows which ranks share a graph
    return {rank: graphs for rank in range(graphs.graph.get("world_size", 1))}


def export(graphs, path, level: str | None = None, hw_config: str | None = None, profile: str = "eager",
           attention: str = "flash") -> None:
    """`level`: the graph collapsed per module or layer (durations summed), after the op-level costs."""
    by_rank = _ranks(graphs)
    if hw_config is not None:
        fill_rank_durations(by_rank, load_hw_config(hw_config), check_profile(profile), check_attention(attention))
    if level:
        from syntorch.trace.levels import level_view
        views = [(level_view(g, level), ranks) for g, ranks in graph_kinds(by_rank)]  # shared graphs stay shared
        by_rank = {r: view for view, ranks in views for r in ranks}
    write_events(trace_events(by_rank)["traceEvents"], path)

