"""Levels for people: the op graph collapsed to one node per module or per transformer layer.

A level is a view computed from the op-level TraceGraph, never a separate trace. Ops are grouped into
contiguous runs (in traced order) of the same key and phase, so collapsing cannot create a cycle: a
module called once per phase becomes one node; collectives stay nodes of their own, so every level
shows the communication. Only tensors that cross a group boundary are kept, and parameters are dropped
(their bytes are in the group's `bytes_read`). Group nodes are `op` nodes named by their key, with
summed `flops`, `bytes_read`, `bytes_written`, `duration_us` (when every member has one) and `num_ops`.

For drawing, folds.py keeps one copy of each run of identical layers and decode steps.
"""
from syntorch.models import LAYER_PATH
from syntorch.trace.graph import LEVELS, TraceGraph, collective_attrs, op_attrs


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
    """Contiguous runs of one key and phase, cut where a collective (another stream) reads a member's
    output, directly or through ops that launch nothing (views; ops inside another's kernel), or a member
    reads a collective's: a group starts when all its inputs exist and its outputs exist when it ends, so
    an uncut run would hold back an all-reduce its first op feeds (Megatron's input gradient, overlapping
    the weight gradient) and simulate a different step than the ops do. An op that launches nothing and
    feeds a collective is a run of its own (a view: what reads it waits for what it read)."""
    attrs, succ = graph.node_attrs, graph.succs
    work = [(n, d) for n, d in attrs.items() if d["kind"] != "tensor"]
    collectives = [n for n, d in work if d["kind"] == "collective"]
    reads = {r for c in collectives for t in succ[c] for r in succ[t]}  # what reads a collective's output
    return cut_runs(work, key, reads, feeding(graph, collectives))


def cut_runs(work: list[tuple[int, dict]], key, reads: set, feeds: set) -> list[list[int]]:
    """_runs of the ops and collectives `work` ((node, attributes), in order), given the nodes that read a
    collective's output (`reads`) and those a collective reads (`feeds`: feeding's)."""
    runs, last = [], None
    for node, d in work:
        here = (key(d), d["phase"]) if d["kind"] == "op" else None  # collectives are never merged
        feeding = here is not None and node in feeds
        if here is None or here != last or node in reads or (feeding and launches_nothing(d)):
            runs.append([])
        runs[-1].append(node)
        last = None if feeding else here
    return runs


def launches_nothing(d: dict) -> bool:
    return d["kind"] == "op" and (d.get("is_view") or d.get("duration_us") == 0)


def feeding(graph: TraceGraph, collectives: list[int]) -> set[int]:
    """The nodes a collective reads the output of, directly or through ops that launch nothing: walked back
    from the collectives (a few per layer), not asked of every op."""
    attrs, pred = graph.node_attrs, graph.preds
    found, todo = set(), list(collectives)
    while todo:
        for t in pred[todo.pop()]:
            for p in pred[t]:
                if p not in found:
                    found.add(p)
                    if launches_nothing(attrs[p]):
                        todo.append(p)
    return found


def _collapse(graph: TraceGraph, runs: list[list[int]], level: str) -> TraceGraph:
    """The view's nodes and edges are made as plain dicts, numbered as they come, and added at once."""
    out = TraceGraph(**{**graph.graph, "level": level})
    attrs, pred, succ = graph.node_attrs, graph.preds, graph.succs
    nodes, edges, orders = [], [], {}
    new_tensor: dict[int, int] = {}
    for members in runs:
        # a run is every op and collective from its first to its last node: in the run iff in that range
        first, last = members[0], members[-1]
        inputs, outputs = {}, []  # (inputs: an ordered set)
        for node in members:
            add_boundary(attrs, pred, succ, node, first, last, inputs, outputs)
        for t in inputs:
            if t not in new_tensor:
                new_tensor[t] = copy_tensor(nodes, attrs[t])
        node = len(nodes)
        nodes.append(run_attrs(attrs, members, level, orders))
        edges += [(new_tensor[t], node, {"arg": arg}) for arg, t in enumerate(inputs)]
        for arg, t in enumerate(outputs):
            new_tensor[t] = copy_tensor(nodes, attrs[t])
            edges.append((node, new_tensor[t], {"arg": arg}))
    out.append(nodes, edges, copy=False)
    return out


def add_boundary(attrs, pred, succ, node: int, first: int, last: int, inputs: dict, outputs: list,
                 by_id: bool = False) -> None:
    """Adds what member `node` of the run [first, last] reads from outside it to `inputs` (an ordered set; not
    parameters) and what it writes that is read outside it, or is the run's final result nobody reads (e.g.
    logits), to `outputs`. `by_id`: its inputs in the order of their ids, not of its edges."""
    for t in sorted(pred[node]) if by_id else pred[node]:
        if t in inputs or attrs[t]["is_param"]:
            continue
        for p in pred[t]:  # (loops, not any(): a level view asks this of 10^5 tensors)
            if first <= p <= last:
                break  # made inside the run
        else:
            inputs[t] = None
    for t, edge in succ[node].items():
        readers = succ[t]
        if not readers:
            if node == last and edge["arg"] == 0:
                outputs.append(t)
            continue
        for r in readers:
            if not first <= r <= last:
                outputs.append(t)
                break


def copy_tensor(nodes: list[dict], d: dict) -> int:
    """What add_tensor would make of tensor node d (its fields, a name if it had none), as the next of `nodes`."""
    node = len(nodes)
    nodes.append({**d, "name": d["name"] or f"t{node}", "shape": list(d["shape"])})
    return node


def run_attrs(attrs: dict, members: list[int], level: str, orders: dict) -> dict:
    """The attributes of a run's node (`attrs`: the graph's node_attrs), as add_collective or add_op would make
    them (same fields, same order); `orders`: each group's collectives so far in the view (add_collective's
    `order`)."""
    first = attrs[members[0]]
    if first["kind"] == "collective":
        group = tuple(first["group"])
        orders[group] = orders.get(group, -1) + 1
        fields = {k: v for k, v in first.items() if k not in ("kind", "collective", "group", "bytes", "order")}
        return collective_attrs(first["collective"], group=group, nbytes=first["bytes"], order=orders[group], **fields)
    flops = bytes_read = bytes_written = duration = 0
    is_view = timed = True
    for n in members:  # one pass: a level view sums 10^5 ops
        d = attrs[n]
        flops += d["flops"]
        bytes_read += d["bytes_read"]
        bytes_written += d["bytes_written"]
        is_view = is_view and d["is_view"]
        timed = timed and d.get("duration_us") is not None
        duration = duration + d["duration_us"] if timed else duration
    key = layer_of(first["module"]) if level == "layer" else first["module"]
    node = op_attrs(key or "model", key, first["phase"], flops, bytes_read, bytes_written, is_view)
    node["num_ops"] = len(members)
    if timed:
        node["duration_us"] = duration
    return node
