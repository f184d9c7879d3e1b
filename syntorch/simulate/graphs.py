"""TraceGraphs as simulator programs, once per rank kind.

A frame says which ranks share a program and how the communication of one program meets another's:
- `RankFrame`: every rank its own program (foreign traces, and the reference the symmetric form is tested
  against); a collective waits for every rank of its group, a recv for its sender's send.
- `MeshFrame`: the ranks of a pipeline stage run one graph (trace/training.py traces its representative,
  dp 0, cp 0 and tp 0; the others are translations along dp, cp and tp, Mesh.translate). A group inside one
  stage (TP, CP, DP) has one member program: its ranks reach it at the same time. A group across stages
  (pipeline pairs, the tied embedding) meets the other stages' representatives, which name it by the same
  translation-free form: each rank moved back by the place of the group's lowest rank (Mesh.translate).
"""
from syntorch.parallel.mesh import DIMS, Mesh
from syntorch.simulate.engine import COMPUTE, P2P, Program, Sync
from syntorch.trace.graph import TraceGraph


class RankFrame:
    """`kind_of` (default: every rank its own): rank -> the program it runs, for ranks that share one graph
    (RankTraces.put_shared) whose groups and peers name the other programs' ranks as they are."""

    def __init__(self, kind_of: dict | None = None):
        self.kind_of = kind_of

    def kind(self, rank: int):
        return rank if self.kind_of is None else self.kind_of.get(rank, rank)

    def canonical(self, ranks) -> tuple:
        return tuple(ranks)

    def label(self, group) -> str:
        """Every rank named: the label names the group's stream, one per communicator."""
        return "ranks " + ",".join(map(str, sorted(group)))


class MeshFrame:
    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.pp_stride = mesh.stride("pp")
        self.labels = {}  # group -> its label: naming a group reads every member's coordinates

    def kind(self, rank: int) -> int:  # its stage: asked for every member of every group, so plain arithmetic
        return rank // self.pp_stride % self.mesh.pp

    def canonical(self, ranks) -> tuple:
        """The group as its stage representatives name it: moved back by its lowest rank's place."""
        lowest = min(ranks)
        return tuple(self.mesh.translate(r, lowest, back=True) for r in ranks)

    def label(self, group) -> str:
        """The communicator's kind, which names its stream: every group of a rank has its own (the mesh's
        names: tp, cp, dp, dp_cp, ep, expert_dp; across stages only Megatron's embedding group)."""
        key = tuple(group)
        if key not in self.labels:
            self.labels[key] = "embedding" if self.mesh.dims_of(group) == ("pp",) else self.mesh.name(group)
        return self.labels[key]


def graph_program(graph: TraceGraph, name: str, frame, ranks: int = 1, nodes=None,
                  isolated: bool = False) -> tuple[Program, list[int]]:
    """The program of `graph`'s ops and collectives (those in `nodes`, default all) in traced order, and the
    graph node of each task. `isolated`: a step simulated on its own (steps.py): what meets other kinds
    (p2p, groups across kinds) takes no time here, the step-level program adds it; dependencies on nodes
    outside `nodes` are dropped.

    An op without time (a view, or an op inside another's kernel under the fused profile) launches nothing:
    it is no task and holds no place on the compute stream; what reads it waits for what it read. (As a
    task it would sit in stream order, and an all-reduce of a gradient reshaped after the weight-gradient
    GEMM would wait for that GEMM.)"""
    attrs, pred = graph.node_attrs, graph.preds
    rank = graph.graph.get("rank", 0)
    program, tasks_of, node_of, seen = Program(name, ranks), {}, [], {}
    for n in (attrs if nodes is None else nodes):
        d = attrs[n]
        if d["kind"] == "tensor":
            continue
        deps = {task for t in pred[n] for p in pred[t] if p in tasks_of for task in tasks_of[p]}
        duration = d.get("duration_us") or 0.0
        if d["kind"] == "op":
            if duration:
                tasks_of[n] = (program.add(d["name"], COMPUTE, duration, list(deps)),)
                node_of.append(n)
            else:
                tasks_of[n] = tuple(deps)
            continue
        stream, sync = _comm(d, rank, frame, seen)
        if isolated and sync is not None:  # it meets another kind: the step-level program runs it
            duration, sync = 0.0, None
        tasks_of[n] = (program.add(f"{d['module']}:{d['collective']}" if d["module"] else d["collective"],
                                   stream, duration, list(deps), sync),)
        node_of.append(n)
    return program, node_of


def _comm(d: dict, rank: int, frame, seen: dict) -> tuple[str, Sync | None]:
    kind = d["collective"]
    if kind in ("send", "recv"):
        src, dst = (rank, d["dst"]) if kind == "send" else (d["src"], rank)
        pair = frame.canonical((src, dst))
        occurrence = seen[(pair, d["tag"])] = seen.get((pair, d["tag"]), -1) + 1
        return P2P, Sync(kind, ("p2p", pair, d["tag"], occurrence))
    group = sorted(d["group"])
    members = len({frame.kind(r) for r in group})
    if members == 1:
        return "comm " + frame.label(group), None
    return "comm " + frame.label(group), Sync("coll", ("coll", frame.canonical(group), d["order"]), members)


def kind_programs(graphs: dict, frame) -> list[Program]:
    """One program per kind: `graphs` maps a kind's name to its (representative's) graph."""
    return [graph_program(g, name, frame)[0] for name, g in graphs.items()]
