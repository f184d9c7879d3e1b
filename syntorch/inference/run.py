"""run_inference(spec, outputs): the one entry of `syntorch infer`, and the only place that decides how a run
is carried out:

- one rank (cpu/cuda, --tp 1): run the model in this process, traced when outputs are asked for;
- real ranks (cpu/cuda, --tp N and/or --pp M): N*M local processes spawned torchrun-style (gloo on CPU,
  NCCL on CUDA), or the ranks torchrun started; each loads the model, keeps its stage and shard and runs
  it (pipeline stages as parallel/pipeline_inference.py says); rank 0 writes;
- symbolic (meta): rank 0 traced against the fake backend, every other TP rank sharing its graph; with
  --pp each stage traced once and its other TP ranks' graphs derived from it (trace/generation.py).

What the model does is spec.run_model's choice, the same in all three: a decoder generates, an encoder
predicts its masked tokens in one pass.

Each writes run.json and what `outputs` asks for into a folder that appears whole or not at all.
"""
import os

import torch
import torch.distributed as dist

from syntorch.config import torch_dtype
from syntorch.errors import UserError
from syntorch.generate import stream_friendly_weights
from syntorch.inference.outputs import RunOutputs, write_run_outputs
from syntorch.inference.spec import (InferenceSpec, check_checkpoint_layout, check_fits_model, load_model,
                                     make_prompt, resolve_config, run_model, run_record, sampling_of, write_run_json)
from syntorch.outdir import atomic_output_dir
from syntorch.parallel.launch import check_devices, init_distributed, spawn, under_torchrun
from syntorch.parallel.mesh import Mesh, init_groups
from syntorch.parallel.pipeline_inference import PipelineForward, chain_group, check_pipeline
from syntorch.parallel.tensor import check_tp
from syntorch.trace.decode_steps import SymbolicGeneration
from syntorch.trace.generation import trace_pp_symbolic, trace_run, trace_tp_ranks
from syntorch.trace.graph import RankTraces
from syntorch.userfiles import read_json


def run_inference(spec: InferenceSpec, out_dir, outputs: RunOutputs | None = None,
                  force: bool = False) -> dict | None:
    """Checks everything it can before any model is built or process started, runs, and returns run.json's
    record (None on torchrun's ranks other than 0). `out_dir` follows syntorch.outdir's policy: an earlier
    run's folder is replaced only with `force`."""
    outputs = outputs or RunOutputs()
    sampling_of(spec)  # validates temperature/top_k/top_p
    config = resolve_config(spec)
    check_fits_model(spec, config)
    prompt = make_prompt(spec, config)  # each rank of a real run makes the same one from the seed
    check_tp(config, spec.tp)
    check_pipeline(config, spec.pp, spec.sp)
    check_checkpoint_layout(spec)
    if torch.device(spec.device).type == "meta":
        return _in_output_dir(out_dir, force, lambda tmp: _symbolic(spec, config, prompt, tmp, outputs))
    if spec.pp > 1 and outputs.any:
        raise UserError("traces of a --pp run are made symbolically: add --device meta for them, or drop "
                        "--visualize_trace/--chakra/--hw_config/--comm_debug for a real run")
    if spec.tp * spec.pp > 1 or under_torchrun():
        return _real_ranks(spec, out_dir, force, outputs)
    return _in_output_dir(out_dir, force, lambda tmp: _one_rank(spec, config, prompt, tmp, outputs))


def _in_output_dir(out_dir, force: bool, run) -> dict:
    with atomic_output_dir(out_dir, force, "--out", expect=["run.json"]) as tmp:
        return run(tmp)


def _traces(graph, world: int) -> RankTraces:
    # TP ranks run the same ops on same-shaped shards (trace/generation.py's trace_tp_symbolic)
    traces = RankTraces(world)
    traces.put_shared(range(world), lambda: graph)
    return traces


def _finish(spec, config, prompt, result, graph, out_dir, outputs, traces: RankTraces | None = None) -> dict:
    """run.json (and the outputs asked for, from `traces`, or `graph` standing for every rank) into out_dir."""
    record = run_record(spec, config, prompt, result)
    if outputs.any:
        record["trace"] = write_run_outputs(traces or _traces(graph, spec.tp), out_dir, outputs)
        if "predicted" in record["trace"]:  # the simulated latency (syntorch/simulate) at the top, by the run
            record["predicted"] = record["trace"].pop("predicted")
    write_run_json(record, out_dir)
    return record


def _one_rank(spec, config, prompt, out_dir, outputs) -> dict:
    model = load_model(spec, config)
    stream_friendly_weights(model)  # this run owns the model: the decode-friendly weight layout is ours to pick
    graph, result = _run(spec, config, model, prompt, outputs)
    return _finish(spec, config, prompt, result, graph, out_dir, outputs)


def _run(spec, config, model, prompt, outputs, forward=None, **trace_args) -> tuple:
    """(graph, result) of run_model, traced only when outputs are asked for (graph None otherwise)."""
    def run(m, phase_scope):
        return run_model(spec, config, m, prompt, phase_scope, forward)
    if outputs.any:
        return trace_run(model, run, **trace_args)
    return None, run(model, None)


def _symbolic(spec, config, prompt, out_dir, outputs) -> dict:
    # a decoder's later decode steps are derived from its first ones (trace/decode_steps.py), built only
    # when an output reads them
    generation = None if config.encoder else SymbolicGeneration(prompt.ids.shape[1], tuple(prompt.pads),
                                                                spec.output_tokens)
    dtype = torch_dtype(spec.dtype)
    if spec.pp > 1:
        traces, result = trace_pp_symbolic(
            config, lambda m, scope, forward: run_model(spec, config, m, prompt, scope, forward),
            spec.rank_plan, spec.beam_width, dtype, generation)
    else:
        traces, result = trace_tp_ranks(config, lambda m, scope: run_model(spec, config, m, prompt, scope),
                                        spec.rank_plan, dtype, generation)
    return _finish(spec, config, prompt, result, None, out_dir, outputs, traces)


def _real_ranks(spec, out_dir, force, outputs) -> dict | None:
    """Spawn spec.tp * spec.pp local ranks (or join torchrun's); rank 0 writes into the output folder."""
    world = spec.tp * spec.pp
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise UserError(f"torchrun started {os.environ['WORLD_SIZE']} ranks but --tp {spec.tp} x --pp "
                            f"{spec.pp} is {world}; make --nproc_per_node equal their product")
        if int(os.environ["RANK"]) != 0:  # only rank 0 writes, into a folder made whole at the end
            tp_inference_rank(spec, "", outputs)
            return None
    else:
        check_devices(spec.device, world)

    def write(tmp) -> dict:
        args = (spec, str(tmp), outputs)
        if under_torchrun():
            tp_inference_rank(*args)  # this process is rank 0
        else:
            spawn(tp_inference_rank, world, args)  # a failing rank raises RankFailed, printed as one line
        return read_json(tmp / "run.json", "run record")
    return _in_output_dir(out_dir, force, write)


def tp_inference_rank(spec, out_dir: str, outputs: RunOutputs) -> None:
    """One rank of a TP x PP run: load the model, keep this rank's stage and shard, run it; rank 0 writes."""
    rank, world = init_distributed(spec.device)
    mesh = Mesh(pp=spec.pp, tp=spec.tp)
    groups = init_groups(mesh)
    chain = chain_group(mesh) if spec.pp > 1 else None
    config = resolve_config(spec)
    prompt = make_prompt(spec, config)
    model = load_model(spec, config, groups)  # only this rank's stage and shard (parallel/assemble.py)
    forward = PipelineForward(groups, chain, config.n_layer, spec.beam_width) if spec.pp > 1 else None
    stream_friendly_weights(model)
    graph, result = _run(spec, config, model, prompt, outputs, forward, rank=rank, world_size=world,
                         meta={"tp": spec.tp, "pp": spec.pp, "sequence_parallel": spec.sp})
    _check_same_tokens(_chosen(config, result), groups.tp)
    if rank == 0:
        _finish(spec, config, prompt, result, graph, out_dir, outputs)


def _chosen(config, result) -> list[int]:
    """What the model chose, flat: the generated sequences, or the top ids at each predicted position."""
    if config.encoder:
        return [i for row in result.top_ids for top in row for i in top]
    return [t for seq in result.tokens for t in seq]


def _check_same_tokens(tokens: list[int], group) -> None:
    """Every rank must have chosen the same tokens (they see the same gathered logits and seed)."""
    mine = torch.tensor(tokens, dtype=torch.long)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    if any(not torch.equal(mine, other) for other in everyone):
        raise RuntimeError("TP ranks chose different tokens; their logits diverged")
