"""`syntorch trace`: a training step of a TP x PP x DP (ZeRO, SP) plan as per-rank Chakra traces.

    workload = trace_workload(config, plan, hw=load_hw_config("h100-sxm"))
    summary = write_workload(workload, "runs/g175-256", level="module")

Steps: trace each pipeline stage once on meta (trace/training.py) -> durations from the hardware config ->
Chakra nodes of each stage's representative rank (export/chakra.py's `chakra_nodes`) -> every rank's file
from its stage's nodes, serialized once, with only what differs per rank patched in: the process-group id
(`pg_name`) of each communication node and the peer (`comm_src`/`comm_dst`) of each send and recv. Those
attributes are encoded apart and appended to the node's bytes (a protobuf message may carry a repeated field
in several pieces), so writing a rank is joining byte strings.
"""
import json
import types
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from chakra.schema.protobuf import et_def_pb2 as et
from chakra.src.third_party.utils.protolib import encodeMessage
from google.protobuf.internal.encoder import _VarintBytes

from syntorch.config import ModelConfig
from syntorch.export import chakra
from syntorch.hardware import HardwareConfig
from syntorch.outdir import atomic_output_dir
from syntorch.parallel.plans import TrainPlan, plan_group_ranks
from syntorch.trace.cost import fill_durations
from syntorch.trace.graph import TraceGraph
from syntorch.trace.levels import level_view
from syntorch.trace.training import (probe_stage, representative, schedule_stage, shift_stage, traced_stage_for,
                                     translate)

PER_RANK = ("pg_name", "comm_src", "comm_dst")  # the attributes that differ between ranks of a stage


@dataclass
class Workload:
    config: ModelConfig
    plan: TrainPlan
    stages: list[TraceGraph]  # one per pipeline stage: its representative rank's training step
    hw_name: str | None = None


def trace_workload(config: ModelConfig, plan: TrainPlan, dtype=torch.bfloat16,
                   hw: HardwareConfig | None = None) -> Workload:
    source = traced_stage_for(config, plan)
    probes = {s: probe_stage(config, plan, s, dtype) for s in sorted(set(source))}
    stages = []
    for s in range(plan.pp):
        probe, blocks = probes[source[s]]
        if source[s] != s:
            offset = plan.stage(config, s).layers[0] - plan.stage(config, source[s]).layers[0]
            probe = shift_stage(probe, plan.mesh, s, offset)
        stages.append(schedule_stage(probe, blocks, plan))
    for graph in stages if hw else ():  # after shifting: a moved group may span nodes where the source did not
        fill_durations(graph, hw)
    return Workload(config, plan, stages, hw.name if hw else None)


def group_ids(plan: TrainPlan, tied: bool) -> dict[tuple[int, ...], int]:
    """Every process group of the plan -> its comm-group id, 1, 2, ... ("0" means all ranks to ASTRA-sim)."""
    ids = {}
    for ranks in plan_group_ranks(plan.mesh, tied):
        ids.setdefault(tuple(sorted(ranks)), len(ids) + 1)
    return ids


class StageTemplate:
    """One stage's Chakra nodes, serialized once; `body(rank)` gives any of its ranks' node bytes."""

    def __init__(self, specs: list[chakra.NodeSpec], groups: dict[tuple, int], plan: TrainPlan, rep: int):
        self.mesh, self.rep, self.groups = plan.mesh, rep, groups
        self.group_of_id = {str(i): g for g, i in groups.items()}
        self.static: list[bytes] = []  # node bytes without the per-rank attributes
        self.slots: list[tuple] = []  # per node: () or ((attr, representative's value), ...)
        for spec in specs:
            fixed = [a for a in spec.attrs if a[0] not in PER_RANK]
            self.static.append(chakra.to_proto(spec._replace(attrs=fixed)).SerializeToString())
            self.slots.append(tuple((name, value) for name, _, value in spec.attrs if name in PER_RANK))
        self._encoded: dict[tuple, bytes] = {}

    def _per_rank(self, slot: tuple, rank: int) -> bytes:
        attrs = []
        for name, value in slot:
            if name == "pg_name":
                members = self.group_of_id[value]
                attrs.append(et.AttributeProto(name=name, string_val=str(
                    self.groups[tuple(sorted(translate(self.mesh, r, rank) for r in members))])))
            else:
                attrs.append(et.AttributeProto(name=name, int64_val=translate(self.mesh, value, rank)))
        return et.Node(attr=attrs).SerializeToString()

    def body(self, rank: int) -> bytes:
        parts, cache = [], {}
        for static, slot in zip(self.static, self.slots):
            extra = b""
            if slot:
                if slot not in cache:
                    cache[slot] = self._per_rank(slot, rank)
                extra = cache[slot]
            parts += (_VarintBytes(len(static) + len(extra)), static, extra)
        return b"".join(parts)


def write_workload(workload: Workload, out_dir, level: str = "module", force: bool = False,
                   progress: bool = True) -> dict:
    """Every rank's `<model>.<rank>.et`, `comm_groups.json`, `tensor_trace_chakra.json` (rank 0) and
    `summary.json` into `out_dir`, whole or not at all. Returns the summary."""
    config, plan = workload.config, workload.plan
    mesh, world = plan.mesh, plan.mesh.world_size
    views = [level_view(g, level) for g in workload.stages]
    groups = group_ids(plan, config.tied_head)
    _, notes = chakra.scan_groups(views)
    templates, headers = [], []
    for stage, view in enumerate(views):
        specs = chakra.chakra_nodes(view, groups)
        templates.append(StageTemplate(specs, groups, plan, representative(mesh, stage)))
        headers.append((view, any(s.duration_micros for s in specs)))
        if stage == 0:
            rank0_specs = specs
    total = 0
    with atomic_output_dir(out_dir, force=force, allow_existing=False) as tmp:
        chakra._write_json_form(tmp / "tensor_trace_chakra.json", _header(headers[0], config, level, notes, 0),
                                rank0_specs)
        for rank in _ranks(world, progress):
            stage = mesh.coords(rank)[1]
            path = tmp / f"{config.name}.{rank}.et"
            with open(path, "wb") as f:
                encodeMessage(f, _header(headers[stage], config, level, notes, rank))
                f.write(templates[stage].body(rank))
            total += path.stat().st_size
        (tmp / "comm_groups.json").write_text(json.dumps({str(i): list(g) for g, i in groups.items()}))
        summary = summarize(workload, views, level)
        summary.update(et_bytes=total, comm_groups=len(groups), notes=notes)
        (tmp / "summary.json").write_text(json.dumps(summary, indent=1))
    return {**summary, "dir": str(out_dir), "prefix": str(Path(out_dir) / config.name)}


def _header(header: tuple, config: ModelConfig, level: str, notes: list[str], rank: int) -> et.GlobalMetadata:
    view, durations = header
    graph = types.SimpleNamespace(graph={**view.graph, "rank": rank})
    return chakra.global_metadata(graph, config.name, level, notes, durations)


def _ranks(world: int, progress: bool):
    if not progress:
        return range(world)
    from rich.progress import track
    return track(range(world), description=f"writing {world} rank traces", transient=True)


def summarize(workload: Workload, views: list[TraceGraph], level: str) -> dict:
    """Per stage (every rank of a stage has the same figures): FLOPs, compute bytes, communication bytes by
    kind, node counts, the schedule, its ranks; and how many distinct rank traces there were."""
    plan, mesh = workload.plan, workload.plan.mesh
    stages = []
    for s, (graph, view) in enumerate(zip(workload.stages, views)):
        ops = [d for _, d in graph.ops()]
        comms = [d for _, d in graph.collectives()]
        by_kind = {}
        for d in comms:
            by_kind.setdefault(d["collective"], [0, 0])
            by_kind[d["collective"]][0] += 1
            by_kind[d["collective"]][1] += d["bytes"]
        stages.append({
            "stage": s, "layers": [min(plan.stage(workload.config, s).layers), max(plan.stage(workload.config, s).layers)],
            "ranks": [r for r in range(mesh.world_size) if mesh.coords(r)[1] == s],
            "flops": {p: sum(d["flops"] for d in ops if d["phase"] == p) for p in ("forward", "backward", "optimizer")},
            "compute_bytes": sum(d["bytes_read"] + d["bytes_written"] for d in ops),
            "comm_bytes": sum(d["bytes"] for d in comms),
            "comm": {k: {"count": n, "bytes": b} for k, (n, b) in sorted(by_kind.items())},
            "ops": len(ops), "chakra_nodes": sum(1 for _ in view.work()),
            "compute_us": sum(d.get("duration_us", 0.0) for d in ops),
            "comm_us": sum(d.get("duration_us", 0.0) for d in comms),
            "schedule": graph.graph["pipeline_schedule"],
        })
    return {"model": workload.config.name, "plan": asdict(plan), "world_size": mesh.world_size, "level": level,
            "hw_config": workload.hw_name, "distinct_rank_traces": len(stages),
            "rank_layout": "rank = ((dp_idx * pp) + pp_stage) * tp + tp_rank", "stages": stages}
