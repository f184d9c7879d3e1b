"""A training step traced on `meta`, one pipeline stage at a time.

Ranks that differ only in their DP, CP and TP index run the same ops on same-shaped shards with the same
collectives, over groups that are a translation of each other along the dp, cp and tp axes of the mesh (a CP
rank's chunks differ from another's in their positions only, values a meta trace does not hold). So each
stage is traced once, as its representative rank (dp 0, cp 0, tp 0), and every other rank's trace is the
representative's with global ranks mapped by `Mesh.translate` (tests trace every rank and compare). The one other
difference is which output of a split a TP rank reads under sequence parallel (its own part): same shapes,
same dependencies, other tensor ids, which Chakra keeps only as IOInfo text that simulators do not read.

Middle stages (neither first nor last) with as many layers run the same ops on other layers: the trace of
one is the other's with layer indices shifted and global ranks moved along pp (`shift_stage`, also tested).

Micro-batches repeat: a probe runs at most PROBE_MICROBATCHES of them (every kind of step: the first
backward creates the gradients, middle ones accumulate, the last one synchronises them) and the stage's
step is assembled from copies of the probed steps in the stage's own schedule (step_schedule.py).
"""
import contextlib
import dataclasses

import torch

from syntorch.config import ModelConfig
from syntorch.models import LAYER_PATH, layer_path
from syntorch.nodynamo import plain_step
from syntorch.parallel import plans
from syntorch.parallel.distributed import symbolic_world
from syntorch.parallel.mesh import Mesh, init_groups
from syntorch.trace.graph import TraceGraph, with_node_attrs
from syntorch.trace.meta_cache import MetaCache
from syntorch.trace.step_schedule import schedule_stage, set_schedule
from syntorch.trace.tracer import Tracer


PROBE_MICROBATCHES = 4  # enough to see every kind of step: first, middle (after a middle), and last backward
# what costing steps needs (syntorch/simulate): the first and the last backward; a middle one is the last
# without what only the last runs (probe_stage's `syncs`; layer_probe.middle_steps), and a middle backward
# after the first costs what one after a middle does (the same ops; only their tensors' versions differ,
# which copies must get right)
COST_MICROBATCHES = 2


def trace_stage(config: ModelConfig, plan: plans.TrainPlan, stage: int, dtype=torch.float32,
                rank: int | None = None, replicate: bool = True) -> TraceGraph:
    """The training step of one rank of `stage` (default: its representative) on meta, fake collectives.

    `replicate`: trace at most PROBE_MICROBATCHES micro-batches and assemble the step from their copies
    (`schedule_stage`); else run every micro-batch in the stage's schedule (tests compare the two)."""
    if replicate:
        return schedule_stage(*probe_stage(config, plan, stage, dtype, rank), plan)
    graph, blocks = _run_stage(config, plan, stage, dtype, rank)
    return set_schedule(graph, plan, list(blocks), [start for start, _ in blocks.values()])


def probe_stage(config, plan, stage, dtype=torch.float32, rank=None,
                microbatches: int = PROBE_MICROBATCHES, syncs: list | None = None) -> tuple[TraceGraph, dict]:
    """A short run of the stage -- at most `microbatches` of the plan's micro-batches, all forwards then all
    backwards (chunk by chunk under interleaving) -- and where each step's nodes are:
    {(kind, microbatch, chunk): (first node, end)}. `syncs` (a list): gets the spans [first node, end) of
    what only a chunk's last backward runs, in order: the gradient sync's bucket launches and, last, the end
    of backward (its `finish`). Without them a last backward is a middle one (accumulation after
    accumulation), node for node (tests/plan/test_two_probes.py): so COST_MICROBATCHES is two."""
    probe = dataclasses.replace(plan, microbatches=min(plan.microbatches, microbatches), schedule="gpipe")
    return _run_stage(config, probe, stage, dtype, rank, syncs=syncs)


def probe_optimizer(config: ModelConfig, plan: plans.TrainPlan, stage: int, dtype=torch.float32,
                    rank: int | None = None) -> tuple[TraceGraph, dict]:
    """The stage's end of backward and optimizer step on their own: no micro-batch runs; every gradient is
    accumulated first, untraced, as backward would (so overlap has launched its buckets; their reduced
    gradients are named grad_sync.flat.<bucket>); then the end of backward is traced (the nodes before the
    ("optimizer", None, None) block) and the optimizer step (that block)."""
    return _run_stage(config, dataclasses.replace(plan, schedule="gpipe"), stage, dtype, rank, microbatches=0)


def _accumulate_gradients(run: plans.StageRun, zero: int) -> None:
    """Every parameter's gradient accumulated in backward's order (the reverse of registration), so DDP/ZeRO's
    hooks see them as in the last backward; FSDP's and ZeRO's shards just hold one."""
    if zero != 3:
        run.grad_sync.active = True
        for p in reversed(list(run.model.parameters())):
            torch.autograd.backward(p, torch.zeros_like(p))
    for p in [*run.model.parameters(), *run.grad_sync.optimizer_params()]:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def _run_stage(config, plan, stage, dtype, rank, microbatches: int | None = None,
               syncs: list | None = None) -> tuple[TraceGraph, dict]:
    """`microbatches=0`: no step but the end of backward and the optimizer's, on gradients set beforehand.
    `syncs`: probe_stage's."""
    mesh = plan.mesh
    rank = mesh.representative(stage) if rank is None else rank
    meta = {"model": config.name, "tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "cp": plan.cp, "ep": plan.ep,
            "stage": stage,
            "sequence_parallel": plan.sp, "zero": plan.zero, "mode": plan.mode}
    with symbolic_world(rank, mesh.world_size), MetaCache():  # below the Tracer's modes, see meta_cache.py
        groups = init_groups(mesh, config.tied_head, only_mine=True)
        run = plans.apply_plans(config, plan, groups, "meta", dtype)
        run.optimizer.step = plain_step(run.optimizer)  # the same ops, without importing torch._dynamo
        batches = [(torch.zeros(plan.micro_batch_size, plan.seq, dtype=torch.long, device="meta"),) * 2
                   for _ in range(plan.microbatches if microbatches is None else microbatches)]
        # (each micro-batch its own tensors, like its own data)
        if not batches:
            _accumulate_gradients(run, plan.zero)
        steps = []
        with Tracer(run.model, rank=rank, world_size=mesh.world_size, meta=meta, default_phase=None) as tracer:
            _name_optimizer_state(tracer, run)
            if syncs is not None:
                _mark_syncs(run.grad_sync, tracer.graph, syncs)
            # what lives across the step first, so every step's nodes look alike wherever it runs
            # (FSDP's flat parameters are buffers, and under mixed precision its shards are not the optimizer's
            # parameters: either would be first seen inside the first forward, which then differs from the next)
            # (held to the end: a name is kept by id, which a freed tensor would hand on)
            state = [*run.model.parameters(), *run.model.buffers(), *run.grad_sync.optimizer_params(),
                     *run.optimizer.param_groups[0]["params"],
                     *(v for state in run.optimizer.state.values() for v in state.values()),
                     *(b.flat for b in getattr(run.grad_sync, "all_buckets", ()) if b.flat is not None),
                     *(run.context.inputs().values() if run.context else ())]  # CP positions and mask
            for t in state:
                tracer.tensor_node(t)
            plans.train_step(run, batches, tracer.phase,
                             on_step=lambda kind, m, c: steps.append(((kind, m, c), len(tracer.graph))))
            if syncs is not None:  # the markers hold grad_sync and the tracer: left in place, a cycle
                del run.grad_sync.finish
                if hasattr(run.grad_sync, "mark"):
                    run.grad_sync.mark = contextlib.nullcontext
    ends = [start for _, start in steps[1:]] + [len(tracer.graph)]
    return tracer.graph, {key: (start, end) for (key, start), end in zip(steps, ends)}


def _mark_syncs(grad_sync, graph: TraceGraph, syncs: list) -> None:
    """The gradient sync's bucket launches (its `mark`: FSDP has none) and its end of backward append the
    span of nodes they add to `syncs`."""
    @contextlib.contextmanager
    def mark():
        start = len(graph)
        yield
        syncs.append((start, len(graph)))

    def end_of_backward(finish=grad_sync.finish):
        with mark():
            finish()

    grad_sync.finish = end_of_backward
    if hasattr(grad_sync, "mark"):
        grad_sync.mark = mark


def _name_optimizer_state(tracer: Tracer, run: plans.StageRun) -> None:
    """Names for what the optimizer updates besides the model's parameters (ZeRO/FSDP shards, FP32 masters,
    AdamW's moments and step): state that outlives the step, which the fused profile's optimizer pass writes
    back (trace/kernels.py) and the schedule tracks as it does parameters; and, for an end of backward traced
    alone, the buckets' reduced gradients overlap launched before it (layer_probe.py joins them to a step's)."""
    for i, p in enumerate(run.grad_sync.optimizer_params()):
        tracer.names.setdefault(id(p), (f"optimizer.shard.{i}", False))
    for i, p in enumerate(run.optimizer.param_groups[0]["params"]):
        tracer.names.setdefault(id(p), (f"optimizer.{i}.master", False))
        for key, v in run.optimizer.state[p].items():
            tracer.names[id(v)] = (f"optimizer.{i}.{key}", False)
    for k, bucket in enumerate(getattr(run.grad_sync, "all_buckets", ())):  # launched before a traced finish
        if bucket.flat is not None:
            tracer.names[id(bucket.flat)] = (f"grad_sync.flat.{k}", False)


def traced_stage_for(config: ModelConfig, plan: plans.TrainPlan) -> list[int]:
    """For each stage, the stage whose probe it is derived from (itself when it must be traced): middle
    stages whose chunks hold layers of the same kinds, as far apart (probes run GPipe's order, the same on
    every stage; shift_stage moves every chunk's layers by one offset)."""
    source, first_middle = [], {}
    for s in range(plan.pp):
        stage = plan.stage(config, s)
        chunks = stage.chunks or (stage.layers,)
        key = (tuple(tuple(layer_kind(config, i, plan.moe_load) for i in chunk) for chunk in chunks),
               tuple(chunk[0] - stage.layers[0] for chunk in chunks))
        source.append(first_middle.setdefault(key, s) if 0 < s < plan.pp - 1 else s)
    return source


def layer_kind(config: ModelConfig, layer: int, load=None) -> tuple:
    """What makes one layer's ops differ from another's: its MLP (DeepSeek's dense first layers), its window
    and, given a stated routing load (TrainPlan.moe_load: a row per MoE layer), an MoE layer's row."""
    moe = bool(config.n_experts) and layer >= config.first_k_dense
    return moe, config.layer_window(layer), tuple(load[layer - config.first_k_dense]) if moe and load else None


def shift_stage(graph: TraceGraph, mesh: Mesh, to_stage: int, layer_offset: int) -> TraceGraph:
    """A middle stage's trace moved to `to_stage`: `layers.i` -> `layers.{i + layer_offset}` in module and
    tensor names, global ranks (groups, peers) moved by the stage difference along pp (around the chain: a
    group holding every stage, the gradient norm's, is itself moved)."""
    moved, attrs = _stage_move(graph, mesh, to_stage, layer_offset)
    out = TraceGraph(**attrs)
    # edges in graph.copy()'s order: by source node, then by target
    out.append(map(moved, graph.node_attrs.values()),
            ((u, v, e) for u, targets in graph.succs.items() for v, e in targets.items()))
    return out


def shift_view(view: TraceGraph, mesh: Mesh, to_stage: int, layer_offset: int) -> TraceGraph:
    """What a graph made from a shifted stage (its schedule, its level view) would be, made from another shifted
    copy of the same probe with the same schedule: the view's nodes moved as shift_stage moves them (a level's
    group, named by its module, renamed too), its edges shared, not copied (read-only). Scheduling, level views
    and Chakra nodes see names, modules and groups only as keys, and the move is one-to-one, so they make the
    same nodes and edges of both; shift_stage's edge order, unlike the tracer's, is the same for every copy. A tensor
    whose name is kept is the view's own dict (read-only too)."""
    moved, attrs = _stage_move(view, mesh, to_stage, layer_offset)
    return with_node_attrs(view, {n: moved(d) for n, d in view.node_attrs.items()}, **attrs)


def _stage_move(graph: TraceGraph, mesh: Mesh, to_stage: int, layer_offset: int) -> tuple:
    """shift_stage's move of one node's attributes, and the moved graph's attributes."""
    shift = (to_stage - graph.graph["stage"]) * mesh.stride("pp")
    span = mesh.pp * mesh.stride("pp")
    renamed, groups = {}, {}

    def move(rank: int) -> int:  # pp is one digit of the rank: moved around the chain, the others kept
        return rank - rank % span + (rank + shift) % span

    def move_group(group: list) -> list:  # a group is moved once, however many nodes it is on
        key = tuple(group)
        if key not in groups:
            groups[key] = sorted(map(move, group))
        return groups[key]

    def rename(name: str) -> str:
        if not name.startswith("layers."):  # LAYER_PATH's start: most tensors' names (t<node>) are kept
            return name
        if name not in renamed:
            renamed[name] = LAYER_PATH.sub(lambda m: layer_path(int(m.group(1)) + layer_offset), name)
        return renamed[name]

    def moved(d: dict) -> dict:
        if d["kind"] == "tensor":  # most keep their name (t<node>): then the dict itself (shift_stage copies it,
            # shift_view's readers do not write tensors)
            name = rename(d["name"])
            return d if name == d["name"] else {**d, "name": name}
        if d["kind"] == "op":
            out = {**d, "module": rename(d["module"])}
            if "num_ops" in d:  # a level's group, named by its module
                out["name"] = rename(d["name"])
            return out
        return {**d, "module": rename(d["module"]), "group": move_group(d["group"]),
                "src": None if d["src"] is None else move(d["src"]),
                "dst": None if d["dst"] is None else move(d["dst"])}

    return moved, {**graph.graph, "stage": to_stage, "rank": move(graph.graph["rank"])}
