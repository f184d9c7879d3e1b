"""Tracing a whole generation (prefill + decode steps) in one call, as `syntorch infer` does."""
import torch

from syntorch import generate as gen
from syntorch.trace.graph import TraceGraph
from syntorch.trace.tracer import Tracer


def graph_meta(config, **extra) -> dict:
    """Graph attributes describing the run (model name, parallel degrees, ...)."""
    return {"model": config.name, **extra}


def trace_generation(model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int,
                     sampling: "gen.Sampling | None" = None, *, rank: int = 0, world_size: int = 1,
                     meta: dict | None = None, **generate_kwargs) -> tuple[TraceGraph, "gen.GenerationResult"]:
    """Run `syntorch.generate.generate` under a Tracer; ops are labelled prefill / decode[i].

    Only the model steps are recorded (cache set-up and bookkeeping between steps are not)."""
    meta = {**graph_meta(model.config), **(meta or {})}
    with Tracer(model, rank=rank, world_size=world_size, meta=meta, default_phase=None) as tracer:
        result = gen.generate(model, prompt, max_new_tokens, sampling or gen.Sampling(),
                              phase_scope=tracer.phase, **generate_kwargs)
    return tracer.graph, result
