"""Tracing a whole run (generation: prefill + decode steps; an encoder's one pass) in one call, as `syntorch
infer` does, on one rank or, symbolically, for every rank of a tensor-parallel or TP x PP run."""
import functools
import logging
from collections.abc import Callable

import torch

from syntorch import generate as gen
from syntorch.models import layer_path
from syntorch.parallel.assemble import RankPlan, assemble_rank
from syntorch.parallel.distributed import symbolic_world
from syntorch.parallel.mesh import Mesh, init_groups
from syntorch.parallel.pipeline_inference import PipelineForward, chain_group
from syntorch.parallel.tensor import check_tp
from syntorch.trace.graph import RankTraces, TraceGraph, with_node_attrs
from syntorch.trace.decode_steps import (StepScope, StepsTraced, SymbolicGeneration, derive_steps, learn_rule,
                                         replicated_ids)
from syntorch.trace.replicate import first_layer_only, replicate_layers
from syntorch.trace.tracer import Tracer

log = logging.getLogger(__name__)


def trace_run(model: torch.nn.Module, run: Callable, *, rank: int = 0, world_size: int = 1,
              meta: dict | None = None, replicate: bool | None = None,
              generation: SymbolicGeneration | None = None) -> tuple[TraceGraph, object]:
    """`run(model, phase_scope)` under a Tracer that records only inside `phase_scope(name)` (generate's
    steps). Returns the graph and what `run` returned (trace_lazily, with the graph built at once)."""
    build, result = trace_lazily(model, run, rank=rank, world_size=world_size, meta=meta, replicate=replicate,
                                 generation=generation)
    return build(), result


def trace_lazily(model: torch.nn.Module, run: Callable, *, rank: int = 0, world_size: int = 1,
                 meta: dict | None = None, replicate: bool | None = None,
                 generation: SymbolicGeneration | None = None) -> tuple[Callable[[], TraceGraph], object]:
    """trace_run's graph as a function that builds it, and what `run` returned.

    `replicate` (default: when the model has several transformer layers, unless they are MoE layers run on
    values) records only the first layer and
    copies its trace for the others (replicate.py): the same graph as a full trace, since every layer runs
    the same ops on the same shapes. On `meta` only the first layer runs; on a real device every layer runs
    (the values need them) and the others go unrecorded, which keeps tracing cheap.

    `generation` (`run` generates it on meta): only its first decode steps are traced, the others derived
    (decode_steps.py) when the graph is built -- never, for a run that writes no trace. Its result is
    meta's, known beforehand."""
    meta = {"model": model.config.name, **(meta or {})}
    layers = getattr(model, "layers", None)
    symbolic = next(model.parameters()).is_meta
    if replicate is None:  # real MoE layers route tokens each their own way: expert shapes differ between layers
        replicate = (layers is not None and len(layers) > 1 and (symbolic or not model.config.n_experts)
                     and model.config.uniform_layers)  # a copy of layer 0 would stand for unlike layers
    stop = generation.stop_step(model.config) if generation and symbolic else None
    traced = first_layer_only(model) if replicate and symbolic else model
    with Tracer(traced, rank=rank, world_size=world_size, meta=meta, default_phase=None,
                first_layer_only=replicate and not symbolic) as tracer:
        scope = StepScope(tracer, stop) if stop else tracer.phase
        try:
            result = run(traced, scope)
        except StepsTraced:
            result = generation.result()
    graph = tracer.graph
    starts = scope.starts + [len(graph)] if stop else []  # decode[i]'s first node, then the end
    if replicate:
        graph = replicate_layers(graph, tracer.layer_calls, [layer_path(k) for k in layers])
        starts = replicated_ids(starts, tracer.layer_calls, len(layers))
    rule = learn_rule(graph, starts) if stop else None
    if stop and rule is None:  # a step the rule misses: every step traced
        log.info("decode steps of %s not derivable: tracing all %d", model.config.name, generation.decode_steps)
        return trace_lazily(model, run, rank=rank, world_size=world_size, meta=meta, replicate=replicate)
    if rule is None:
        return lambda: graph, result
    return functools.cache(lambda: derive_steps(graph, rule, generation.decode_steps)), result


def trace_generation(model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int,
                     sampling: "gen.Sampling | None" = None, *, rank: int = 0, world_size: int = 1,
                     meta: dict | None = None, replicate: bool | None = None, derive: bool = True,
                     **generate_kwargs) -> tuple[TraceGraph, "gen.GenerationResult"]:
    """`syntorch.generate.generate` traced; ops are labelled prefill / decode[i]. Cache set-up and the
    bookkeeping between steps are not recorded. On meta (with `derive`) the later decode steps are derived."""
    def run(m, phase_scope):
        return gen.generate(m, prompt, max_new_tokens, sampling or gen.Sampling(), phase_scope=phase_scope,
                            **generate_kwargs)
    generation = symbolic_generation(prompt, max_new_tokens, generate_kwargs.get("pads")) if derive else None
    return trace_run(model, run, rank=rank, world_size=world_size, meta=meta, replicate=replicate,
                     generation=generation)


def symbolic_generation(prompt: torch.Tensor, max_new_tokens: int, pads=None) -> SymbolicGeneration | None:
    """What generating from `prompt` does, when it runs on meta (None on a real device: values decide)."""
    if not prompt.is_meta:
        return None
    return SymbolicGeneration(prompt.shape[1], tuple(pads or [0] * prompt.shape[0]), max_new_tokens)


def trace_tp_run(config, run: Callable, tp: int, rank: int, sequence_parallel: bool = False, device: str = "meta",
                 dtype=torch.float32, generation: SymbolicGeneration | None = None) -> tuple[TraceGraph, object]:
    """`run(model, phase_scope)` (a generation, an encoder's pass, ...) traced on one TP rank's model against
    the fake backend (no other process). On `cpu` the weights are random and the collectives move nothing,
    so the numbers are meaningless; the ops, shapes and collectives are the real ones."""
    plan = RankPlan(tp=tp, sp=sequence_parallel, mode="infer")
    build, result = _tp_traced(config, run, plan, rank, device, dtype, generation)
    return build(), result


def _tp_traced(config, run, plan: RankPlan, rank, device, dtype, generation):
    check_tp(config, plan.tp)
    with symbolic_world(rank, plan.tp):
        model = assemble_rank(config, plan, init_groups(plan.mesh), device, dtype).model
        return trace_lazily(model, run, rank=rank, world_size=plan.tp, generation=generation,
                            meta={"tp": plan.tp, "sequence_parallel": plan.sp})


def trace_tp_ranks(config, run: Callable, plan: RankPlan, dtype=torch.float32,
                   generation: SymbolicGeneration | None = None) -> tuple[RankTraces, object]:
    """Every TP rank's graph of `run` on meta under `plan` (a TP plan: tp, sp, FP8), and its result:
    rank 0 traced (trace_tp_run), its graph built on first access and shared by the others (trace_tp_symbolic)."""
    build, result = _tp_traced(config, run, plan, 0, "meta", dtype, generation)
    ranks = RankTraces(plan.tp)
    ranks.put_shared(range(plan.tp), build)
    return ranks, result


def trace_tp_rank(config, prompt: torch.Tensor, max_new_tokens: int, tp: int, rank: int,
                  sequence_parallel: bool = False, device: str = "meta", dtype=torch.float32,
                  sampling=None, derive: bool = True, **generate_kwargs) -> tuple[TraceGraph, "gen.GenerationResult"]:
    """The trace (and generation result) of one TP rank's generation (trace_tp_run). `prompt` is [B, T]
    token ids. On meta (with `derive`) the later decode steps are derived."""
    def run(m, phase_scope):
        return gen.generate(m, prompt.to(device), max_new_tokens, sampling or gen.Sampling(),
                            phase_scope=phase_scope, **generate_kwargs)
    generation = symbolic_generation(prompt.to(device), max_new_tokens, generate_kwargs.get("pads")) if derive else None
    return trace_tp_run(config, run, tp, rank, sequence_parallel, device, dtype, generation)


def trace_tp_symbolic(config, prompt: torch.Tensor, max_new_tokens: int, tp: int,
                      sequence_parallel: bool = False, dtype=torch.float32) -> RankTraces:
    """All `tp` ranks' graphs of a TP generation on meta. TP ranks are symmetric -- the same ops on
    same-shaped shards and the same collectives over the same group -- so rank 0 is traced once (on first
    access) and the others share its graph, differing only in the `rank` graph attribute (tests/parallel/test_tp.py
    proves this against tracing each rank)."""
    check_tp(config, tp)
    ranks = RankTraces(tp)
    ranks.put_shared(range(tp), lambda: trace_tp_rank(config, prompt, max_new_tokens, tp, 0, sequence_parallel,
                                                      "meta", dtype)[0])
    return ranks


def trace_pp_symbolic(config, run: Callable, plan: RankPlan, beam_width: int = 1, dtype=torch.float32,
                      generation: SymbolicGeneration | None = None) -> tuple["StageTraces", object]:
    """Every rank's graph of a TP x PP generation under `plan` on meta, and stage 0's result. `run(model,
    phase_scope, forward)` runs the generation with a pipeline stage's forward. Each stage is traced once, as
    its representative (tp rank 0); its other TP ranks run the same ops over groups and peers translated along
    tp (Mesh.translate), so their graphs are the representative's with the collectives' ranks moved."""
    check_tp(config, plan.tp)
    builds, result = [], None
    for stage in range(plan.pp):
        build, out = _stage_traced(config, run, plan, stage, beam_width, dtype, generation)
        result = out if stage == 0 else result
        builds.append(build)
    return StageTraces(plan.mesh, builds), result


class StageTraces(RankTraces):
    """rank -> graph of a symbolic TP x PP run: each stage's representative graph, built on first use, and
    its other ranks' graphs translated from it when read (chakra/stage_files.py writes their files from the
    representatives alone)."""

    def __init__(self, mesh: Mesh, builds: list[Callable[[], TraceGraph]]):
        super().__init__(mesh.world_size)
        self.mesh = mesh
        self._stages = [functools.cache(build) for build in builds]
        for stage in range(mesh.pp):
            for rank in mesh.stage_ranks(stage):
                self.put_shared([rank], lambda stage=stage, rank=rank: translated(self.stage_graph(stage), mesh, rank))

    def stage_graph(self, stage: int) -> TraceGraph:
        return self._stages[stage]()


def trace_pp_stage(config, run: Callable, mesh: Mesh, stage: int, beam_width: int = 1,
                   dtype=torch.float32, generation: SymbolicGeneration | None = None) -> tuple[TraceGraph, object]:
    """The generation traced on `stage`'s representative rank against the fake backend, on the stage's model
    as assemble_rank builds it (only the stage's layers)."""
    plan = RankPlan(tp=mesh.tp, pp=mesh.pp, mode="infer")
    build, result = _stage_traced(config, run, plan, stage, beam_width, dtype, generation)
    return build(), result


def _stage_traced(config, run, plan: RankPlan, stage, beam_width, dtype, generation):
    mesh = plan.mesh
    rank = mesh.representative(stage)
    with symbolic_world(rank, mesh.world_size):
        groups = init_groups(mesh, only_mine=True)
        forward = PipelineForward(groups, chain_group(mesh, only_mine=True), config.n_layer, beam_width)
        model = assemble_rank(config, plan, groups, "meta", dtype).model
        return trace_lazily(model, lambda m, scope: run(m, scope, forward), rank=rank,
                            world_size=mesh.world_size, generation=generation,
                            meta={"tp": mesh.tp, "pp": mesh.pp, "stage": stage, "sequence_parallel": plan.sp})


def translated(graph: TraceGraph, mesh: Mesh, rank: int) -> TraceGraph:
    """`graph` (a stage representative's) as `rank` of the same stage runs it: every collective's group and
    peers moved by Mesh.translate; the other nodes and all edges shared with `graph`, not copied."""
    if graph.graph["rank"] == rank:
        return graph

    def moved(d: dict) -> dict:
        if d["kind"] != "collective":
            return d
        return {**d, "group": [mesh.translate(r, rank) for r in d["group"]],
                "src": None if d["src"] is None else mesh.translate(d["src"], rank),
                "dst": None if d["dst"] is None else mesh.translate(d["dst"], rank)}

    return with_node_attrs(graph, {n: moved(d) for n, d in graph.node_attrs.items()}, rank=rank)
