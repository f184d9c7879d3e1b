"""Levels for people: the op graph collapsed to one node per module or per transformer layer.

A level is a view computed from the op-level TraceGraph, never a separate trace. Ops are grouped into
contiguous runs (in traced order) of the same key and phase, so collapsing cannot create a cycle: a
module called once per phase becomes one node; collectives stay nodes of their own, so every level
shows the communication. Only tensors that cross a group boundary are kept, and parameters are dropped
(their bytes are in the group's `bytes_read`). Group nodes are `op` nodes named by their key, with
summed `flops`, `bytes_read`, `bytes_written`, `duration_us` (when every member has one) and `num_ops`.
"""
from syntorch.models import LAYER_PATH
from syntorch.trace.graph import LEVELS, TraceGraph


def layer_of(module: str) -> str:
    """layers.3.attn.qkv -> layers.3; lm_head -> lm_head; the root ("") stays ""."""
    match = LAYER_PATH.match(module)
    return match.group(0) if match else module.split(".")[0]


def level_view(graph: TraceGraph, level: str) -> TraceGraph:
    """The graph at `level` (op: the graph itself)."""
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; use one of {', '.join(LEVELS)}")
    if level == "op" or graph.graph.get("level", "op") == level:
        return graph
    key = (lambda d: d["module"]) if level == "module" else (lambda d: layer_of(d["module"]))
    return _collapse(graph, _runs(graph, key), level)


def _runs(graph: TraceGraph, key) -> list[list[int]]:
    runs, last = [], None
    for node, d in graph.work():
        here = (key(d), d["phase"]) if d["kind"] == "op" else None  # collectives are never merged
        if here is None or here != last:
            runs.append([])
        runs[-1].append(node)
        last = here
    return runs


def _collapse(graph: TraceGraph, runs: list[list[int]], level: str) -> TraceGraph:
    out = TraceGraph(**{**graph.graph, "level": level})
    run_of = {node: i for i, members in enumerate(runs) for node in members}
    new_tensor: dict[int, int] = {}
    for i, members in enumerate(runs):
        inputs = _boundary_inputs(graph, members, run_of, i)
        for t in inputs:
            if t not in new_tensor:
                new_tensor[t] = _copy_tensor(out, graph.node_attrs[t])
        node = _add_group(out, graph, members, [new_tensor[t] for t in inputs])
        for arg, t in enumerate(_boundary_outputs(graph, members, run_of, i)):
            new_tensor[t] = _copy_tensor(out, graph.node_attrs[t], (node, {"arg": arg}))
    return out



def _boundary_inputs(graph, members, run_of, i) -> list[int]:
    pred, nodes = graph.preds, graph.node_attrs
    seen = {}  # ordered set
    for node in members:
        for t in pred[node]:
            inside = any(run_of.get(p) == i for p in pred[t])
            if not inside and not nodes[t]["is_param"]:
                seen[t] = None
    return list(seen)


def _boundary_outputs(graph, members, run_of, i) -> list[int]:
    """Outputs read outside the run, and the run's final result if nobody reads it (e.g. logits)."""
    succ, last = graph.succs, members[-1]
    found = []
    for node in members:
        for t, edge in succ[node].items():
            readers = succ[t]
            final = not readers and node == last and edge["arg"] == 0
            if final or any(run_of[r] != i for r in readers):
                found.append(t)
    return found


def _copy_tensor(out: TraceGraph, d: dict, producer: tuple | None = None) -> int:
    """What out.add_tensor would make of tensor node d (its fields, a name if it had none), without its
    argument handling: level views copy 10^5 tensors. `producer`: (op node, edge attributes)."""
    node = len(out)
    edges = [(producer[0], node, producer[1])] if producer else []
    return out.append([{**d, "name": d["name"] or f"t{node}", "shape": list(d["shape"])}], edges)


def _add_group(out: TraceGraph, graph: TraceGraph, members: list[int], inputs: list[int]) -> int:
    first = graph.node_attrs[members[0]]
    if first["kind"] == "collective":
        fields = {k: v for k, v in first.items() if k not in ("kind", "collective", "group", "bytes", "order")}
        return out.add_collective(first["collective"], inputs, group=first["group"], nbytes=first["bytes"], **fields)
    ops = [graph.node_attrs[n] for n in members]
    durations = [d.get("duration_us") for d in ops]
    extra = {"duration_us": sum(durations)} if None not in durations else {}
    key = layer_of(first["module"]) if out.graph["level"] == "layer" else first["module"]
    return out.add_op(key or "model", inputs, module=key, phase=first["phase"],
                      flops=sum(d["flops"] for d in ops), bytes_read=sum(d["bytes_read"] for d in ops),
                      bytes_written=sum(d["bytes_written"] for d in ops),
                      is_view=all(d["is_view"] for d in ops), num_ops=len(ops), **extra)
