"""Predictions from simulated runs: a training step (summary.json's `predicted`), an inference latency
(run.json's `predicted`), each the only prediction its record carries, with the Perfetto timeline of the
simulated run (timeline.py)."""
import json
from dataclasses import dataclass

from syntorch.hardware import HardwareConfig
from syntorch.parallel.moe_load import RankKinds, rank_kinds
from syntorch.outdir import atomic_output_dir
from syntorch.parallel.pipeline import schedule
from syntorch.simulate.engine import Program, Run, simulate
from syntorch.simulate.graphs import RankFrame, graph_program
from syntorch.simulate.stats import kind_stats
from syntorch.simulate.steps import pipeline_programs, stage_costs, step_costs
from syntorch.simulate.timeline import timeline_events, write_events
from syntorch.trace.cost import op_dtype
from syntorch.trace.graph import graph_kinds
from syntorch.trace.graph import no_gc

TIMELINE = "timeline.json"


@dataclass
class Prediction:
    run: Run
    summary: dict

    def write_timeline(self, path) -> None:
        write_events(timeline_events(self.run), path)


# what each MFU of a training summary counts as the model's FLOPs (both 3 x the forward's, however much is recomputed)
# (NeMo 24.07's model_tflops_per_gpu in ../shared/calibration/nemo2407_h100_fp8.csv is the dense one: GPT3-5B's
# 23,406 tokens/s x (6N + 12·L·h·s) = 765 TFLOP/s as published; halving attention would give 736)
MFU_CONVENTIONS = {
    "mfu": "attention over the (query, key) pairs the causal mask keeps, as flash kernels compute them: "
           "Megatron-LM's num_floating_point_operations (attention halved), MaxText's since July 2025 "
           "(PR 1988), NeMo's flops_formulas from 2025 (NVIDIA-NeMo issue 14376)",
    "mfu_dense_attention": "attention over every score, masked or not: Megatron-LM/PaLM's 6N + 12·L·h·s per token "
                           "(Narayanan et al. 2021; Chowdhery et al. 2022, appendix B), NeMo's before 2025",
}


def run_summary(run: Run, model_flops: float = 0.0, hw_flops: float = 0.0, peak_flops: float = 0.0,
                dense_model_flops: float = 0.0) -> dict:
    """Step (or latency) time, rank-weighted means of busy/idle/exposed communication, and per kind the same;
    MFU/HFU when FLOPs (summed over all ranks) and a device peak are given; with `dense_model_flops` (model
    FLOPs with attention over every score) also that MFU, the two conventions named (MFU_CONVENTIONS)."""
    step = run.end_us
    kinds = kind_stats(run)
    world = sum(k["ranks"] for k in kinds)
    mean = {f: sum(k[f] * k["ranks"] for k in kinds) / world for f in ("busy_us", "idle_us", "exposed_comm_us")}
    out = {"step_s": step / 1e6, "exposed_comm_s": mean["exposed_comm_us"] / 1e6,
           "bubble_fraction": mean["idle_us"] / step if step else 0.0, "busy_s": mean["busy_us"] / 1e6,
           "ranks": world,
           "rank_kinds": [{"kind": k["kind"], "ranks": k["ranks"], "busy_s": k["busy_us"] / 1e6,
                           "idle_s": k["idle_us"] / 1e6, "exposed_comm_s": k["exposed_comm_us"] / 1e6,
                           "bubble_fraction": k["idle_us"] / step if step else 0.0,
                           "streams_busy_s": {s: v / 1e6 for s, v in k["streams_busy_us"].items()}} for k in kinds]}
    if peak_flops and step:
        capacity = step / 1e6 * world * peak_flops
        out.update(mfu=model_flops / capacity, hfu=hw_flops / capacity, model_flops=model_flops,
                   hardware_flops=hw_flops, peak_tflops=peak_flops / 1e12)
        if dense_model_flops:
            out.update(mfu_dense_attention=dense_model_flops / capacity, model_flops_dense_attention=dense_model_flops,
                       mfu_conventions=MFU_CONVENTIONS)
    return out


def predict_training(probes: dict, source: list[int], plan, hw: HardwareConfig, profile: str | None = None,
                     attention: str | None = None, kind_probes: dict | None = None) -> Prediction:
    """A training step (or pipelined prefill) from per-stage probes ({stage: trace/layer_probe.py's StageProbe,
    or probe_stage's (graph, blocks)} with durations filled; `source[s]`: the probed stage stage s is a copy of).
    `kind_probes` ({(stage, kind): probe}, workload.Workload's): under a load that makes rank kinds, each
    kind's (moe_load.RankKinds), which then runs its own pipeline programs (_kind_programs)."""
    with no_gc():  # many small lists, none cyclic
        return _predict_training(kind_probes or {(s, 0): p for s, p in probes.items()}, source, plan, hw, profile,
                                 attention)


def _predict_training(probes, source, plan, hw, profile, attention) -> Prediction:
    mesh, M, virtual = plan.mesh, plan.microbatches, getattr(plan, "virtual_stages", 1)
    sync_tp = not getattr(plan, "async_tp_allreduce", True)  # an inference plan has no backward
    kinds = rank_kinds(mesh, plan.moe_load) if any(k for _, k in probes) else RankKinds(mesh)
    costs = {key: stage_costs(probe, mesh, sync_tp) for key, probe in probes.items()}
    optimizer = {key: next((c for k, c in probed.items() if k[0] == "optimizer"), None)
                 for key, probed in costs.items()}
    if plan.mode == "train":
        schedules = [schedule(plan.schedule, s, plan.pp, M, virtual) for s in range(plan.pp)]
    else:
        schedules = [[("F", m, 0) for m in range(M)] for _ in range(plan.pp)]
    by_kind, flops = [], [0, 0, 0]  # model, hardware, model with dense attention: summed over every rank
    for kind in range(kinds.count):
        per_step = [step_costs(costs[source[s], kind], schedules[s], M) for s in range(plan.pp)]
        ranks = kinds.ranks(kind)  # a stage's DP, CP and TP ranks of the kind run its program
        by_kind.append(_kind_programs(pipeline_programs(schedules, per_step, plan.pp, virtual,
                                                     [optimizer[source[s], kind] for s in range(plan.pp)],
                                                     ranks=ranks), kind, kinds.count))
        flops = [total + ranks * kind_flops for total, kind_flops in zip(flops, _flops(per_step, plan.mode))]
    run = simulate([programs[s] for s in range(plan.pp) for programs in by_kind])  # by stage, then kind
    summary = run_summary(run, flops[0], flops[1], hw.peak_flops(_main_dtype(probes)), flops[2])
    for kind, (s, k) in zip(summary["rank_kinds"], ((s, k) for s in range(plan.pp) for k in range(kinds.count))):
        kind.update(stage=s, **({"ep_kind": k} if kinds.count > 1 else {}))
    summary["stages"] = summary["rank_kinds"]
    summary.update(hw_config=hw.name, profile=profile, attention=attention, level="pipeline step", microbatches=M, virtual_stages=virtual)
    return Prediction(run, summary)


def _flops(per_step: list[list], mode: str) -> tuple[int, int, int]:
    """One rank's model, hardware and dense-attention model FLOPs, from the StepCost of each scheduled step."""
    hw_flops = sum(c.hw_flops for stage in per_step for c in stage)
    # a forward-only run's model FLOPs are what it runs (model_flops counts the backward a step would add)
    flops = sum(c.model_flops for stage in per_step for c in stage) if mode == "train" else hw_flops
    dense = sum(c.model_flops_dense for stage in per_step for c in stage) // (1 if mode == "train" else 3)
    return flops, hw_flops, dense


def _kind_programs(programs: list[Program], kind: int, count: int) -> list[Program]:
    """One rank kind's pipeline programs, apart from the other kinds': its sends, recvs and collectives
    across stages meet its own kind's (the same EP index, moved along pp). The kinds of a stage also meet in
    every MoE layer's all-to-all, which a probed step simulates on its own rank kind, at its own size (the
    larger of what the kind sends and receives): so the busiest kind's steps are as long as that all-to-all
    makes them and the step is its pipeline's, but a lighter kind does not wait for it there."""
    if count == 1:
        return programs
    for p in programs:
        p.name += f" EP kind {kind}"
        p.syncs = {i: sync._replace(key=(kind, *sync.key)) for i, sync in p.syncs.items()}
    return programs


def _main_dtype(probes: dict) -> str:
    """The dtype of the op with the most FLOPs: what MFU's peak is taken for."""
    graph = probes[min(probes)][0]  # the first stage's representative
    biggest = max((n for n, d in graph.node_attrs.items() if d["kind"] == "op"),
                  key=lambda n: graph.node_attrs[n]["flops"], default=None)
    return "float32" if biggest is None else op_dtype(graph, biggest)


def predict_inference(traces, hw_name: str, profile: str | None = None, attention: str | None = None) -> Prediction:
    """Latency of an inference run whose graphs have durations: `traces` maps each rank to its graph, ranks
    that run one graph sharing it (RankTraces), each distinct graph simulated once.
    run.json's `predicted`: latency_ms, prefill_ms (to the end of the prompt's pass), decode_ms_per_token."""
    programs, tasks = rank_programs(traces)
    run = simulate(programs)
    phases = [[graph.node_attrs[n]["phase"] for n in nodes] for graph, nodes in tasks]
    latency = run.end_us
    prefill = max((e for ends, kind in zip(run.ends, phases) for e, ph in zip(ends, kind)
                   if ph in ("prefill", "encode", "forward")), default=latency)
    decodes = {ph for kind in phases for ph in kind if ph.startswith("decode")}
    summary = {"latency_ms": latency / 1e3, "prefill_ms": prefill / 1e3,
               "decode_ms_per_token": (latency - prefill) / 1e3 / len(decodes) if decodes else 0.0,
               "exposed_comm_ms": max(k["exposed_comm_us"] for k in kind_stats(run)) / 1e3,
               "hw_config": hw_name, "profile": profile, "attention": attention}
    return Prediction(run, summary)


def rank_programs(traces) -> tuple[list[Program], list[tuple]]:
    """One program per distinct graph of `traces` (rank -> graph; RankTraces' ranks that share a graph run
    one program), and per program (its graph, the graph node of each task)."""
    kinds = graph_kinds(traces)  # (shared graph, its ranks)
    frame = RankFrame({r: k for k, (_, ranks) in enumerate(kinds) for r in ranks})
    programs, tasks = [], []
    for graph, ranks in kinds:
        name = f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}"
        program, nodes = graph_program(graph, name, frame, len(ranks))
        programs.append(program)
        tasks.append((graph, nodes))
    return programs, tasks


def write_prediction(out_dir, record: dict, prediction: Prediction, name: str, force: bool = False) -> None:
    """`record` as `name` (JSON) and the prediction's timeline into `out_dir`, whole or not at all."""
    with atomic_output_dir(out_dir, force, "--out") as tmp:
        (tmp / name).write_text(json.dumps(record, indent=1))
        prediction.write_timeline(tmp / TIMELINE)
