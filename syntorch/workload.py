"""`syntorch trace`: a training step of a TP x PP x DP (ZeRO, SP) plan as per-rank Chakra traces.

    workload = trace_workload(config, plan, hw=load_hw_config("h100-sxm"))
    summary = write_workload(workload, "runs/g175-256", level="module")

Steps: trace each pipeline stage once on meta (trace/training.py) -> durations from the hardware config ->
Chakra nodes of each stage's representative rank (chakra/nodes.py) -> every rank's file from its stage's
nodes, serialized once, with only what differs per rank patched in (chakra/writer.py's StageTemplate): the
comm-group id of each communication node and the peer of each send and recv. Comm-group ids are those of
every process group of the plan's mesh (parallel/mesh.py), numbered by chakra/groups.py.
"""
import json
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from syntorch.chakra.groups import comm_groups_json, group_ids
from syntorch.chakra.nodes import chakra_nodes, global_metadata, rewrite_notes
from syntorch.chakra.writer import StageTemplate, write_json_form
from syntorch.config import ModelConfig
from syntorch.hardware import HardwareConfig
from syntorch.outdir import atomic_output_dir
from syntorch.parallel import memory
from syntorch.parallel.mesh import ORDER
from syntorch.parallel.plans import TrainPlan
from syntorch.simulate.chakra_files import RANK_KINDS, rank_kinds_json
from syntorch.simulate.prediction import TIMELINE, Prediction
from syntorch.trace.cost import fill_durations
from syntorch.trace.graph import TraceGraph, no_gc
from syntorch.trace.layer_probe import StageProbe, layer_probe, whole_probe
from syntorch.trace.levels import level_view
from syntorch.trace.training import (COST_MICROBATCHES, PROBE_MICROBATCHES, probe_stage, schedule_stage, shift_stage,
                                     traced_stage_for)


@dataclass
class Workload:
    config: ModelConfig
    plan: TrainPlan
    stages: list[TraceGraph]  # one per pipeline stage: its representative rank's training step
    hw: HardwareConfig | None = None  # what the durations are from
    traced_stages: int = 0  # stages actually run under the tracer (the others are shifted copies)
    probes: dict = field(default_factory=dict)  # traced stage -> its StageProbe (graph, steps): what predictions use
    source: list[int] = field(default_factory=list)  # stage -> the traced stage it is a copy of
    profile: str = "eager"  # software profile of the durations, when hw is set
    attention: str = "flash"  # the attention kernel of the durations (trace/kernels.py), when hw is set
    memory: list[dict] = field(default_factory=list)  # per stage: parallel/memory.py's estimate of one rank


def trace_workload(config: ModelConfig, plan: TrainPlan, dtype=torch.bfloat16,
                   hw: HardwareConfig | None = None, schedule: bool = True, profile: str = "eager",
                   attention: str = "flash", layer_probes: bool = True) -> Workload:
    """`schedule=False`: only the probes (enough to predict, syntorch/simulate), no stage's whole step; with
    `layer_probes` each probe keeps one and two layers of each run of alike layers (trace/layer_probe.py),
    else every layer. `profile`, `attention`: the software of the durations (trace/kernels.py), with `hw`."""
    with no_gc():
        return _trace_workload(config, plan, dtype, hw, schedule, (profile, attention), layer_probes)


def _trace_workload(config, plan, dtype, hw, schedule, software, layer_probes) -> Workload:
    estimates = [memory.estimate(config, plan, dtype, s) for s in range(plan.pp)]
    if hw:  # before the work: a plan that does not fit is refused, not traced
        memory.check_fits(estimates, hw.memory_gb, hw.name)
    source = traced_stage_for(config, plan)
    if not schedule:  # a prediction needs only the probes, costed
        probe = layer_probe if layer_probes else whole_probe
        probes = {s: probe(config, plan, s, dtype, COST_MICROBATCHES) for s in sorted(set(source))}
        for p in probes.values() if hw else ():
            for graph, _ in (p, p.optimizer) if p.optimizer else (p,):
                fill_durations(graph, hw, *software)
        return Workload(config, plan, [], hw, len(probes), probes, source, *software, estimates)
    # copies need one more micro-batch than costs do
    probes = {s: StageProbe(*probe_stage(config, plan, s, dtype, microbatches=PROBE_MICROBATCHES))
              for s in sorted(set(source))}
    made = (config, plan, hw, len(probes))
    stages = {}
    # shifted copies first: schedule_stage may finish a probe in place (see there); each copy is scheduled
    # before the next is made, so only one unscheduled copy is alive at a time (peak RSS)
    for s in sorted(range(plan.pp), key=lambda s: source[s] == s):
        graph = probes[s][0] if source[s] == s else shift_stage(
            probes[source[s]][0], plan.mesh, s, plan.stage(config, s).layers[0] - plan.stage(config, source[s]).layers[0])
        # after shifting (a moved group may span nodes where the source did not), before scheduling: a copied
        # node keeps its duration (same FLOPs, bytes, dtypes, group), so micro-batches are not costed again
        if hw:
            fill_durations(graph, hw, *software)
        stages[s] = schedule_stage(graph, probes[source[s]][1], plan)
    return Workload(*made[:2], [stages[s] for s in range(plan.pp)], *made[2:], probes, source, *software, estimates)


def write_workload(workload: Workload, out_dir, level: str = "module", force: bool = False,
                   progress: bool = True, prediction: Prediction | None = None) -> dict:
    """Every rank's `<model>.<rank>.et`, `comm_groups.json`, `tensor_trace_chakra.json` (rank 0), the rank
    kinds `syntorch predict` reads (simulate/chakra_files.py) and `summary.json` (with the prediction and its
    timeline when given) into `out_dir`, whole or not at all. Returns the summary."""
    with no_gc():
        return _write_workload(workload, out_dir, level, force, progress, prediction)


def _write_workload(workload, out_dir, level, force, progress, prediction) -> dict:
    config, plan = workload.config, workload.plan
    mesh, world = plan.mesh, plan.mesh.world_size
    views = [level_view(g, level) for g in workload.stages]
    ids = group_ids(ranks for _, ranks in mesh.process_groups(config.tied_head))
    notes = rewrite_notes(views)
    templates, node_counts = [], []
    for stage, view in enumerate(views):
        specs = chakra_nodes(view, ids)
        header = global_metadata(view, config.name, level, notes, any(s.duration_micros for s in specs))
        if stage == 0:  # rank 0 is stage 0's representative: its nodes as they are
            rank0 = (global_metadata(types.SimpleNamespace(graph={**view.graph, "rank": 0}), config.name,
                                     level, notes, any(s.duration_micros for s in specs)), specs)
        del header.attr[[a.name for a in header.attr].index("rank")]
        templates.append(StageTemplate(specs, header, ids, mesh))
        node_counts.append(len(specs))
    total, variants = 0, set()
    with atomic_output_dir(out_dir, force=force) as tmp:
        write_json_form(tmp / "tensor_trace_chakra.json", *rank0)
        for rank in _ranks(world, progress):
            with open(tmp / f"{config.name}.{rank}.et", "wb") as f:
                written, variant = templates[mesh.coordinate(rank).pp].write(f, rank)
            total += written
            variants.add(variant)
        (tmp / "comm_groups.json").write_text(comm_groups_json(ids))
        (tmp / RANK_KINDS).write_text(rank_kinds_json(config.name, mesh, tmp, workload.hw, workload.profile,
                                                       workload.attention))
        summary = summarize(workload, node_counts, level)
        summary.update(et_bytes=total, comm_groups=len(ids), notes=notes, distinct_rank_traces=len(variants))
        if prediction is not None:
            summary["predicted"] = prediction.summary
            prediction.write_timeline(tmp / TIMELINE)
        (tmp / "summary.json").write_text(json.dumps(summary, indent=1))
    return {**summary, "dir": str(out_dir), "prefix": str(Path(out_dir) / config.name)}


def _ranks(world: int, progress: bool):
    if not progress:
        return range(world)
    from rich.progress import track
    return track(range(world), description=f"writing {world} rank traces", transient=True)


def summarize(workload: Workload, node_counts: list[int], level: str) -> dict:
    """Per stage (every rank of a stage has the same figures): FLOPs, compute bytes, communication bytes by
    kind, op and Chakra node counts (as in the files), the schedule, its ranks."""
    plan, mesh = workload.plan, workload.plan.mesh
    stages = []
    for s, (graph, node_count) in enumerate(zip(workload.stages, node_counts)):
        nodes = graph.node_attrs.values()
        ops = [d for d in nodes if d["kind"] == "op"]
        comms = [d for d in nodes if d["kind"] == "collective"]
        flops = dict.fromkeys(("forward", "backward", "optimizer"), 0)
        for d in ops:
            if d["phase"] in flops:
                flops[d["phase"]] += d["flops"]
        by_kind = {}
        for d in comms:
            by_kind.setdefault(d["collective"], [0, 0])
            by_kind[d["collective"]][0] += 1
            by_kind[d["collective"]][1] += d["bytes"]
        stage = plan.stage(workload.config, s)
        stages.append({
            "stage": s, "layers": [stage.layers[0], stage.layers[-1]],
            "chunks": [[chunk[0], chunk[-1]] for chunk in stage.chunks or (stage.layers,)],
            "ranks": mesh.stage_ranks(s),
            "flops": flops,
            "compute_bytes": sum(d["bytes_read"] + d["bytes_written"] for d in ops),
            "comm_bytes": sum(d["bytes"] for d in comms),
            "comm": {k: {"count": n, "bytes": b} for k, (n, b) in sorted(by_kind.items())},
            "ops": len(ops), "chakra_nodes": node_count,
            "compute_us": sum(d.get("duration_us", 0.0) for d in ops),
            "comm_us": sum(d.get("duration_us", 0.0) for d in comms),
            "schedule": graph.graph["pipeline_schedule"],
            "memory_bytes": workload.memory[s] if workload.memory else None,
        })
    return {"model": workload.config.name, "plan": asdict(plan), "world_size": mesh.world_size, "level": level,
            "hw_config": workload.hw.name if workload.hw else None, "profile": workload.profile,
            "attention": workload.attention, "traced_stages": workload.traced_stages, "rank_layout": ORDER, "stages": stages}
