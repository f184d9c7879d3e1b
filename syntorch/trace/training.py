"""A training step traced on `meta`, one pipeline stage at a time.

Ranks that differ only in their DP and TP index run the same ops on same-shaped shards with the same
collectives, over groups that are a translation of each other along the dp and tp axes of the mesh. So
each stage is traced once, as its representative rank (dp 0, tp 0), and every other rank's trace is the
representative's with global ranks mapped by `translate` (tests trace every rank and compare). The one other
difference is which output of a split a TP rank reads under sequence parallel (its own part): same shapes,
same dependencies, other tensor ids, which Chakra keeps only as IOInfo text that simulators do not read.

Middle stages (neither first nor last) with as many layers and the same schedule run the same ops on other
layers: the trace of
one is the other's with layer indices shifted and global ranks moved along pp (`shift_stage`, also tested).

The schedule is part of the trace: a stage runs its steps (forward or backward of a micro-batch) one after
another, so the ops of a step that depend on nothing inside it get a dependency on the last node of the
step before, through a 0-byte `schedule` tensor (kept by every level and exporter, a data dep in Chakra).
"""
import re

import torch

from syntorch.config import ModelConfig
from syntorch.parallel import plans
from syntorch.parallel.comm import symbolic_world
from syntorch.parallel.mesh import Mesh
from syntorch.parallel.pipeline import schedule
from syntorch.trace.graph import TraceGraph
from syntorch.trace.tracer import Tracer


def representative(mesh: Mesh, stage: int) -> int:
    return mesh.rank(0, stage, 0)


def translate(mesh: Mesh, rank: int, to_rank: int) -> int:
    """The rank that plays, for `to_rank`, the part `rank` plays for its stage's representative: shifted
    along dp and tp by to_rank's coordinates, the stage kept."""
    d, s, t = mesh.coords(rank)
    to_d, _, to_t = mesh.coords(to_rank)
    return mesh.rank((d + to_d) % mesh.dp, s, (t + to_t) % mesh.tp)


def trace_stage(config: ModelConfig, plan: plans.TrainPlan, stage: int, dtype=torch.float32,
                rank: int | None = None) -> TraceGraph:
    """The training step of one rank of `stage` (default: its representative) on meta, fake collectives."""
    mesh = plan.mesh
    rank = representative(mesh, stage) if rank is None else rank
    meta = {"model": config.name, "tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "stage": stage,
            "sequence_parallel": plan.sp, "zero": plan.zero, "schedule": plan.schedule,
            "microbatches": plan.microbatches}
    with symbolic_world(rank, mesh.world_size):
        groups = plans.init_plan_groups(mesh, config.tied_head, only_mine=True)
        run = plans.apply_plans(config, plan, groups, "meta", dtype)
        tokens = torch.zeros(plan.micro_batch_size, plan.seq, dtype=torch.long, device="meta")
        batches = [(tokens, tokens)] * plan.microbatches
        steps = []
        with Tracer(run.model, rank=rank, world_size=mesh.world_size, meta=meta, default_phase=None) as tracer:
            plans.train_step(run, batches, tracer.phase,
                             on_step=lambda kind, m: steps.append((kind, m, len(tracer.graph))))
    graph = tracer.graph
    graph.graph["pipeline_schedule"] = [f"{kind}{m}" for kind, m, _ in steps if m is not None]
    add_schedule_deps(graph, [start for _, _, start in steps])
    return graph


def traced_stage_for(config: ModelConfig, plan: plans.TrainPlan) -> list[int]:
    """For each stage, the stage whose trace it is derived from (itself when it must be traced): middle
    stages with as many layers and the same schedule (GPipe's is; 1F1B's warm-up differs per stage)."""
    source, first_middle = [], {}
    for s in range(plan.pp):
        key = (len(plan.stage(config, s).layers), tuple(schedule(plan.schedule, s, plan.pp, plan.microbatches)))
        source.append(first_middle.setdefault(key, s) if 0 < s < plan.pp - 1 else s)
    return source


def shift_stage(graph: TraceGraph, mesh: Mesh, to_stage: int, layer_offset: int) -> TraceGraph:
    """A middle stage's trace moved to `to_stage`: `layers.i` -> `layers.{i + layer_offset}` in module and
    tensor names, global ranks (groups, peers) moved by the stage difference along pp."""
    shift = (to_stage - graph.graph["stage"]) * mesh.tp
    pattern = re.compile(r"^layers\.(\d+)")
    renamed = {}

    def rename(name: str) -> str:
        if name not in renamed:
            renamed[name] = pattern.sub(lambda m: f"layers.{int(m.group(1)) + layer_offset}", name)
        return renamed[name]

    out = graph.copy()
    out.graph.update(stage=to_stage, rank=graph.graph["rank"] + shift)
    for _, d in out.nodes(data=True):
        if d["kind"] == "tensor":
            d["name"] = rename(d["name"])
            continue
        d["module"] = rename(d["module"])
        if d["kind"] == "collective":
            d["group"] = [r + shift for r in d["group"]]
            d["src"] = None if d["src"] is None else d["src"] + shift
            d["dst"] = None if d["dst"] is None else d["dst"] + shift
    return out


def add_schedule_deps(graph: TraceGraph, starts: list[int]) -> None:
    """Step k (nodes from starts[k] to starts[k+1]) runs after step k-1: its first nodes (those with no
    producer inside the step) read a 0-byte tensor written by step k-1's last node."""
    bounds = [*starts, len(graph)]
    work = {n for n, kind in graph.nodes(data="kind") if kind != "tensor"}
    for k in range(1, len(starts)):
        start, end = bounds[k], bounds[k + 1]
        before = [n for n in range(bounds[k - 1], start) if n in work]
        roots = [n for n in range(start, end) if n in work and
                 not any(p >= start for t in graph.pred[n] for p in graph.pred[t])]
        if not before or not roots:
            continue
        token = graph.add_tensor([], "none", 0, name=f"schedule[{k}]", device="meta")
        graph.add_edge(before[-1], token, arg=len(graph.succ[before[-1]]))
        for n in roots:
            graph.add_edge(token, n, arg=len(graph.pred[n]))
