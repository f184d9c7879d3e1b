"""Tensor-parallel generation traced symbolically: every rank's graph in one process, no memory, no peers.

The model is built on `meta`, sharded by apply_tp under torch's fake backend (comm.symbolic_world), and
generation runs under the Tracer. TP ranks are symmetric -- the same ops on same-shaped shards and the same
collectives over the same group -- so rank 0 is traced once and the other ranks share its graph, differing
only in the `rank` graph attribute (tests/test_tp.py proves this against tracing each rank).
"""
import torch

from syntorch.config import ModelConfig
from syntorch.generate import GenerationResult
from syntorch.models import build_model
from syntorch.parallel.comm import symbolic_world
from syntorch.parallel.mesh import Mesh, init_groups
from syntorch.parallel.tensor import apply_tp, check_tp
from syntorch.trace.graph import RankTraces, TraceGraph


def trace_tp_rank(config: ModelConfig, prompt: torch.Tensor, max_new_tokens: int, tp: int, rank: int,
                  sequence_parallel: bool = False, device: str = "meta", dtype=torch.float32,
                  sampling=None, **generate_kwargs) -> tuple[TraceGraph, GenerationResult]:
    """The trace (and generation result) of one TP rank's generation against the fake backend (no other process).

    On `cpu` the weights are random and the collectives move nothing, so the numbers are meaningless;
    the ops, shapes and collectives are the real ones. `prompt` is [B, T] token ids.
    """
    from syntorch.trace.generation import trace_generation

    check_tp(config, tp)
    with symbolic_world(rank, tp):
        model = build_model(config, device=device, dtype=dtype)
        apply_tp(model, init_groups(Mesh(tp=tp)), sequence_parallel)
        return trace_generation(model, prompt.to(device), max_new_tokens, sampling, rank=rank, world_size=tp,
                                meta={"tp": tp, "sequence_parallel": sequence_parallel}, **generate_kwargs)


def trace_tp_symbolic(config: ModelConfig, prompt: torch.Tensor, max_new_tokens: int, tp: int,
                      sequence_parallel: bool = False, dtype=torch.float32) -> RankTraces:
    """All `tp` ranks' graphs: rank 0 traced on meta, shared by the others (traced on first access)."""
    check_tp(config, tp)
    ranks = RankTraces(tp)
    ranks.put_shared(range(tp), lambda: trace_tp_rank(config, prompt, max_new_tokens, tp, 0, sequence_parallel,
                                                      "meta", dtype)[0])
    return ranks


def run_tp_symbolic(spec, out_dir, outputs=None) -> dict:
    """`syntorch infer --device meta --tp N`: trace rank 0 symbolically, write run.json (placeholder tokens,
    the timings of the symbolic run) and what `outputs` (export.run_outputs.RunOutputs) asks for, every rank's
    traces shared from rank 0's."""
    from syntorch import inference
    from syntorch.export.run_outputs import write_run_outputs

    config = inference.resolve_config(spec)
    check_tp(config, spec.tp)
    prompt = inference.make_prompt(spec, config)
    graph, result = trace_tp_rank(config, prompt, spec.num_output_tokens, spec.tp, 0, spec.sp, "meta",
                                  inference.DTYPES[spec.dtype], inference.sampling_of(spec),
                                  stop_tokens=tuple(spec.stop_tokens), beam_width=spec.beam_width)
    record = inference.run_record(spec, config, prompt, result)
    if outputs is not None and outputs.any:
        traces = RankTraces(spec.tp)
        traces.put_shared(range(spec.tp), lambda: graph)
        record["trace"] = write_run_outputs(traces, out_dir, outputs)
    inference.write_run_json(record, out_dir)
    return record
