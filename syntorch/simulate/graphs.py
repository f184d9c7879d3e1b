"""TraceGraphs as simulator programs, once per rank kind.

A frame says which ranks share a program and how the communication of one program meets another's:
- `RankFrame`: every rank its own program (foreign traces, and the reference the symmetric form is tested
  against); a collective waits for every rank of its group, a recv for its sender's send.
- `MeshFrame`: the ranks of a pipeline stage run one graph (trace/training.py traces its representative,
  dp 0, cp 0 and tp 0; the others are translations along dp, cp and tp, Mesh.translate), or, under a routing
  load that makes EP ranks differ, one graph per rank kind of the stage (moe_load.RankKinds: its
  representative differs from the stage's in its EP index only). A group whose members are of one kind has
  one member program: its ranks reach it at the same time. A group of several kinds (the EP all-to-all of
  skewed ranks, pipeline pairs, the tied embedding) meets the other kinds' representatives, which name it
  by the same translation-free form: each rank moved back by the place of the group's lowest rank along
  every dimension but EP's (Mesh.translate), so that a kind's pipeline pairs stay its own.
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

    def kinds_in(self, group) -> int:
        """How many programs meet in `group`."""
        return len({self.kind(r) for r in group})

    def canonical(self, ranks) -> tuple:
        return tuple(ranks)

    def label(self, group) -> str:
        """Every rank named: the label names the group's stream, one per communicator."""
        return "ranks " + ",".join(map(str, sorted(group)))


class MeshFrame:
    """`kinds` (moe_load.RankKinds, default one per stage): the rank kinds of each stage."""

    def __init__(self, mesh: Mesh, kinds=None):
        self.mesh, self.kinds = mesh, kinds
        self.pp_stride = mesh.stride("pp")
        # per group: its label (from every member's coordinates), its kinds, its canonical form (a stage's
        # groups recur in every step, the gradient norm's holding every rank)
        self.labels, self.kinds_of, self.canonicals = {}, {}, {}

    def kind(self, rank: int) -> int:
        """Its stage (plain arithmetic, asked for every member of a group), and its kind in the stage."""
        stage = rank // self.pp_stride % self.mesh.pp
        return stage if self.kinds is None else stage * self.kinds.count + self.kinds.of(rank)

    def kinds_in(self, group) -> int:
        """How many kinds meet in `group` (once per group: the gradient norm's may hold every rank)."""
        key = tuple(group)
        if key not in self.kinds_of:
            self.kinds_of[key] = len({self.kind(r) for r in group})
        return self.kinds_of[key]

    def canonical(self, ranks) -> tuple:
        """The group as the kinds' representatives name it: moved back by its lowest rank's place but EP's."""
        key = tuple(ranks)
        if key not in self.canonicals:
            origin = self.mesh.first(min(key), "ep")
            self.canonicals[key] = tuple(self.mesh.translate(r, origin, back=True) for r in key)
        return self.canonicals[key]

    def label(self, group) -> str:
        """The communicator's kind, which names its stream: every group of a rank has its own (the mesh's
        names: tp, cp, dp, dp_cp, ep, expert_dp; across stages only Megatron's embedding group)."""
        key = tuple(group)
        if key not in self.labels:
            self.labels[key] = "embedding" if self.mesh.dims_of(group) == ("pp",) else self.mesh.name(group)
        return self.labels[key]


def graph_program(graph: TraceGraph, name: str, frame, ranks: int = 1, nodes=None,
                  isolated: bool = False, sync_tp_backward: bool = False) -> tuple[Program, list[int]]:
    """The program of `graph`'s ops and collectives (those in `nodes`, default all) in traced order, and the
    graph node of each task. `isolated`: a step simulated on its own (steps.py): what meets other kinds
    (p2p, groups across kinds) takes no time here, the step-level program adds it; dependencies on nodes
    outside `nodes` are dropped.

    An op without time (a view, or an op inside another's kernel under the fused profile) launches nothing:
    it is no task and holds no place on the compute stream; what reads it waits for what it read. (As a
    task it would sit in stream order, and an all-reduce of a gradient reshaped after the weight-gradient
    GEMM would wait for that GEMM.)

    `sync_tp_backward` (the plan's async_tp_allreduce false): a TP collective of the backward pass waits for the
    compute issued before it, and the next compute waits for it, as Megatron-LM 2021 ran it (the all-reduce in
    _CopyToModelParallelRegion's backward, after the linear's input and weight gradients, torch.distributed's
    default async_op=False)."""
    attrs, pred = graph.node_attrs, graph.preds
    rank = graph.graph.get("rank", 0)
    program, tasks_of, node_of, seen, groups = Program(name, ranks), {}, [], {}, {}
    last_compute = gate = None  # sync_tp_backward: the compute task before, the collective the next one waits for
    for n in (attrs if nodes is None else nodes):
        d = attrs[n]
        if d["kind"] == "tensor":
            continue
        deps = {task for t in pred[n] for p in pred[t] if p in tasks_of for task in tasks_of[p]}
        duration = d.get("duration_us") or 0.0
        if d["kind"] == "op":
            if duration:
                deps |= {gate} if gate is not None else set()
                last_compute, gate = program.add(d["name"], COMPUTE, duration, list(deps)), None
                tasks_of[n] = (last_compute,)
                node_of.append(n)
            else:
                tasks_of[n] = tuple(deps)
            continue
        stream, sync = _comm(d, rank, frame, seen, groups)
        if isolated and sync is not None:  # it meets another kind: the step-level program runs it
            duration, sync = 0.0, None
        blocking = sync_tp_backward and d["phase"] == "backward" and stream == "comm tp"
        if blocking and last_compute is not None:
            deps.add(last_compute)
        task = program.add(f"{d['module']}:{d['collective']}" if d["module"] else d["collective"], stream, duration,
                           list(deps), sync)
        tasks_of[n], gate = (task,), task if blocking else gate
        node_of.append(n)
    return program, node_of


def _comm(d: dict, rank: int, frame, seen: dict, groups: dict) -> tuple[str, Sync | None]:
    """The collective's stream and, when it meets other kinds, its Sync (`seen`: p2p occurrences so far;
    `groups`: each group's stream, kinds and canonical form, worked out once per program: a DP group holds
    hundreds of ranks, and a step meets it once per bucket)."""
    kind = d["collective"]
    if kind in ("send", "recv"):
        src, dst = (rank, d["dst"]) if kind == "send" else (d["src"], rank)
        pair = frame.canonical((src, dst))
        occurrence = seen[(pair, d["tag"])] = seen.get((pair, d["tag"]), -1) + 1
        return P2P, Sync(kind, ("p2p", pair, d["tag"], occurrence))
    key = tuple(d["group"])
    if key not in groups:
        group = sorted(key)
        members = frame.kinds_in(group)
        groups[key] = "comm " + frame.label(group), members, members > 1 and frame.canonical(group)
    stream, members, canonical = groups[key]
    return stream, None if members == 1 else Sync("coll", ("coll", canonical, d["order"]), members)


def kind_programs(graphs: dict, frame) -> list[Program]:
    """One program per kind: `graphs` maps a kind's name to its (representative's) graph."""
    return [graph_program(g, name, frame)[0] for name, g in graphs.items()]
