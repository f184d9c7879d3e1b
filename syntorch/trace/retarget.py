"""A stage's probe moved to another layout's mesh, for layouts that share it (plan/evaluate.py).

A probe of a stage's layers runs the same ops on the same shapes in every layout that gives the stage the
same part (the same kept layers, the same ends of the model) and the same TP, CP, micro-batch and options;
what the pipeline depth and the DP degree change in it is which global ranks its groups and peers name (a DDP
or ZeRO-1 bucket reduces the same bytes whatever the DP degree). So the probe of one layout serves another with
every group replaced by the other mesh's group of the same kind (tp, dp, dp_cp, ...) around that mesh's
representative of the stage (the one group along pp alone, the tied embedding's, pairs the first and the last
stage), and each send and recv pointed at the neighbouring stage it meets: the next one
for a forward's send and a backward's recv, the previous one for the others (around the ring under
interleaving). Collectives then cost what they cost on their new ranks (which may span other nodes).
"""
from syntorch.parallel.mesh import Mesh
from syntorch.trace.cost import kernel_of, kernel_us
from syntorch.trace.graph import TraceGraph


def retarget(graph: TraceGraph, mesh: Mesh, to_mesh: Mesh, to_stage: int, end: int | None = None) -> TraceGraph:
    """Nodes [0, end) of `graph` (a probe of a stage of `mesh`) as stage `to_stage` of `to_mesh` runs them
    (module docstring); the nodes keep their ids and attributes but the ranks."""
    rank = to_mesh.representative(to_stage)
    groups = {}

    def group(ranks: list) -> list:  # each group moved once, however many nodes it is on
        key = tuple(ranks)
        if key not in groups:
            dims = mesh.dims_of(ranks)
            groups[key] = to_mesh.group(rank, *dims) if dims != ("pp",) else \
                [to_mesh.representative(0), to_mesh.representative(to_mesh.pp - 1)]  # the tied embedding's
        return groups[key]

    def moved(d: dict) -> dict:
        if d["kind"] != "collective":
            return d
        if d["collective"] not in ("send", "recv"):
            return {**d, "group": group(d["group"])}
        ahead = (d["collective"] == "send") == (d["phase"] == "forward")
        peer = to_mesh.representative((to_stage + (1 if ahead else -1)) % to_mesh.pp)
        src, dst = (rank, peer) if d["collective"] == "send" else (peer, rank)
        return {**d, "src": src, "dst": dst, "group": sorted((src, dst))}

    out = TraceGraph(**{**graph.graph, "rank": rank, "stage": to_stage, "pp": to_mesh.pp, "dp": to_mesh.dp,
                        "world_size": to_mesh.world_size})
    end = len(graph) if end is None else end
    # ops, tensors and edges as the probe's dicts (recost_collectives writes only the collectives, new here)
    out.append((moved(graph.node_attrs[n]) for n in range(end)),
               ((u, v, e) for v in range(end) for u, e in graph.preds[v].items()), copy=False)
    return out


def recost_collectives(graph: TraceGraph, hw, profile: str, attention: str) -> None:
    """Each collective's duration on its (new) ranks; the ops keep theirs."""
    for n, d in graph.collectives():
        d["duration_us"] = kernel_us(kernel_of(graph, n, {}), hw, profile, attention)
