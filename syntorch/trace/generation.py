"""Tracing a whole generation (prefill + decode steps) in one call, as `syntorch infer` does."""
import torch

from syntorch import generate as gen
from syntorch.trace.graph import TraceGraph
from syntorch.trace.replicate import first_layer_only, replicate_layers
from syntorch.trace.tracer import Tracer


def graph_meta(config, **extra) -> dict:
    """Graph attributes describing the run (model name, parallel degrees, ...)."""
    return {"model": config.name, **extra}


def trace_generation(model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int,
                     sampling: "gen.Sampling | None" = None, *, rank: int = 0, world_size: int = 1,
                     meta: dict | None = None, replicate: bool | None = None,
                     **generate_kwargs) -> tuple[TraceGraph, "gen.GenerationResult"]:
    """Run `syntorch.generate.generate` under a Tracer; ops are labelled prefill / decode[i].

    Only the model steps are recorded (cache set-up and bookkeeping between steps are not). `replicate`
    (default: on `meta`, where no values can differ between layers) runs only the first transformer layer
    and copies its trace for the others (replicate.py); the graph is the same as a full trace."""
    meta = {**graph_meta(model.config), **(meta or {})}
    layers = getattr(model, "layers", None)
    if replicate is None:
        replicate = prompt.is_meta and layers is not None and len(layers) > 1
    traced = first_layer_only(model) if replicate else model
    with Tracer(traced, rank=rank, world_size=world_size, meta=meta, default_phase=None) as tracer:
        result = gen.generate(traced, prompt, max_new_tokens, sampling or gen.Sampling(),
                              phase_scope=tracer.phase, **generate_kwargs)
    if not replicate:
        return tracer.graph, result
    return replicate_layers(tracer.graph, tracer.layer_calls, [f"layers.{k}" for k in layers]), result
