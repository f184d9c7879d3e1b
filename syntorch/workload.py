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
import struct
import types
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from chakra.schema.protobuf import et_def_pb2 as et
from google.protobuf.internal.encoder import _VarintBytes

from syntorch.config import ModelConfig
from syntorch.export import chakra
from syntorch.hardware import HardwareConfig
from syntorch.outdir import atomic_output_dir
from syntorch.parallel.plans import TrainPlan, plan_group_ranks
from syntorch.trace.cost import fill_durations
from syntorch.trace.graph import TraceGraph, no_gc
from syntorch.trace.levels import level_view
from syntorch.trace.training import probe_stage, schedule_stage, shift_stage, traced_stage_for, translate

PER_RANK = ("pg_name", "comm_src", "comm_dst")  # the attributes that differ between ranks of a stage


@dataclass
class Workload:
    config: ModelConfig
    plan: TrainPlan
    stages: list[TraceGraph]  # one per pipeline stage: its representative rank's training step
    hw_name: str | None = None
    traced_stages: int = 0  # stages actually run under the tracer (the others are shifted copies)


def trace_workload(config: ModelConfig, plan: TrainPlan, dtype=torch.bfloat16,
                   hw: HardwareConfig | None = None) -> Workload:
    with no_gc():
        return _trace_workload(config, plan, dtype, hw)


def _trace_workload(config, plan, dtype, hw) -> Workload:
    source = traced_stage_for(config, plan)
    probes = {s: probe_stage(config, plan, s, dtype) for s in sorted(set(source))}
    moved = {s: shift_stage(probes[source[s]][0], plan.mesh, s, plan.stage(config, s).layers[0] -
                            plan.stage(config, source[s]).layers[0]) for s in range(plan.pp) if source[s] != s}
    # shifted first: schedule_stage may finish a probe in place (see there)
    unscheduled = [moved[s] if s in moved else probes[s][0] for s in range(plan.pp)]
    # after shifting (a moved group may span nodes where the source did not), before scheduling: a copied
    # node keeps its duration (same FLOPs, bytes, dtypes, group), so micro-batches are not costed again
    for graph in unscheduled if hw else ():
        fill_durations(graph, hw)
    stages = [schedule_stage(graph, probes[source[s]][1], plan) for s, graph in enumerate(unscheduled)]
    return Workload(config, plan, stages, hw.name if hw else None, len(probes))


class GroupTable:
    """Every process group of the plan -> its comm-group id, and for any rank the id of the group that plays,
    for it, the part a representative's group plays. Ids all have the same number of digits (1000, 1001, ...
    for up to 9000 groups; "0" would mean all ranks to ASTRA-sim), so a rank's file is its representative's
    with equal-length strings swapped."""

    def __init__(self, plan: TrainPlan, tied: bool):
        self.mesh = mesh = plan.mesh
        groups = list(dict.fromkeys(tuple(sorted(ranks)) for ranks in plan_group_ranks(mesh, tied)))
        first = 10 ** len(str(len(groups)))
        self.ids: dict[tuple[int, ...], int] = {g: first + i for i, g in enumerate(groups)}
        self.group_of_id = {str(i): g for g, i in self.ids.items()}
        # TP groups by (dp, stage), DP groups by (stage, tp); any other group is along pp
        self.by_coords = {"tp": {}, "dp": {}}
        self.kind: dict[tuple, str] = {}
        dp_stride = mesh.pp * mesh.tp  # TP groups are consecutive ranks, DP groups this far apart
        for group, i in self.ids.items():
            d, s, t = mesh.coords(group[0])
            if t == 0 and group == tuple(range(group[0], group[0] + mesh.tp)):
                self.kind[group], self.by_coords["tp"][(d, s)] = "tp", i
            elif d == 0 and group == tuple(range(group[0], group[0] + mesh.dp * dp_stride, dp_stride)):
                self.kind[group], self.by_coords["dp"][(s, t)] = "dp", i
            else:
                self.kind[group] = "pp"

    def for_rank(self, group: tuple[int, ...], rank: int) -> int:
        """A TP or DP group maps to rank's TP or DP group; a group along pp (a stage pair, the tied-embedding
        pair) to the same stages at rank's dp and tp index."""
        kind, mesh = self.kind[group], self.mesh
        d, s, t = mesh.coords(rank)
        if kind == "tp":
            return self.by_coords["tp"][(d, s)]
        if kind == "dp":
            return self.by_coords["dp"][(s, t)]
        return self.ids[tuple(sorted(mesh.rank(d, mesh.coords(r)[1], t) for r in group))]


class StageTemplate:
    """One stage's Chakra nodes serialized once, as its representative's; `write(f, rank)` writes any of its
    ranks' file by overwriting, in a copy, what differs: the group id in each communication node's `pg_name`
    (fixed width, see GroupTable) and the peer of each send and recv (a fixed32 `comm_src`/`comm_dst`). Those
    attributes are appended to the node's other bytes (a repeated `attr` may come in pieces), so their
    values sit at known offsets."""

    def __init__(self, specs: list[chakra.NodeSpec], header: et.GlobalMetadata, table: GroupTable):
        self.table = table
        self.header = header.SerializeToString()  # without `rank`, appended per rank the same way
        self.group_at: dict[tuple, list[int]] = {}  # representative's group -> offsets of its id in the body
        self.peer_at: list[tuple[int, int]] = []  # (offset of a fixed32 peer, representative's peer)
        chunks, size = [], 0
        for spec in specs:
            fixed = [a for a in spec.attrs if a[0] not in PER_RANK]
            per_rank = [(name, value) for name, _, value in spec.attrs if name in PER_RANK]
            attrs = [et.AttributeProto(name=name, string_val=value) if name == "pg_name" else
                     et.AttributeProto(name=name, fixed32_val=value) for name, value in per_rank]
            node = chakra.to_proto(spec._replace(attrs=fixed)).SerializeToString()
            tail = [et.Node(attr=[a]).SerializeToString() for a in attrs]
            data = b"".join([node, *tail])
            size += len(_VarintBytes(len(data))) + len(node)
            for (name, value), piece in zip(per_rank, tail):
                size += len(piece)
                if name == "pg_name":
                    self.group_at.setdefault(table.group_of_id[value], []).append(size - len(value))
                else:
                    self.peer_at.append((size - 4, value))
            chunks += (_VarintBytes(len(data)), data)
        self.body = np.frombuffer(b"".join(chunks), dtype=np.uint8)
        self.group_at = {g: np.array(at)[:, None] + np.arange(len(str(next(iter(table.ids.values())))))
                         for g, at in self.group_at.items()}

    def write(self, f, rank: int) -> int:
        """Writes rank's file to `f`; returns the bytes written."""
        mesh, table = self.table.mesh, self.table
        rank_attr = et.GlobalMetadata(attr=[et.AttributeProto(name="rank", int64_val=rank)]).SerializeToString()
        head = _VarintBytes(len(self.header) + len(rank_attr)) + self.header + rank_attr
        body = self.body.copy()
        for group, at in self.group_at.items():
            body[at] = np.frombuffer(str(table.for_rank(group, rank)).encode(), dtype=np.uint8)
        for at, peer in self.peer_at:
            body[at:at + 4] = np.frombuffer(struct.pack("<I", translate(mesh, peer, rank)), dtype=np.uint8)
        f.write(head)
        f.write(body.data)
        return len(head) + body.nbytes


def write_workload(workload: Workload, out_dir, level: str = "module", force: bool = False,
                   progress: bool = True) -> dict:
    """Every rank's `<model>.<rank>.et`, `comm_groups.json`, `tensor_trace_chakra.json` (rank 0) and
    `summary.json` into `out_dir`, whole or not at all. Returns the summary."""
    with no_gc():
        return _write_workload(workload, out_dir, level, force, progress)


def _write_workload(workload, out_dir, level, force, progress) -> dict:
    config, plan = workload.config, workload.plan
    mesh, world = plan.mesh, plan.mesh.world_size
    views = [level_view(g, level) for g in workload.stages]
    table = GroupTable(plan, config.tied_head)
    _, notes = chakra.scan_groups(views)
    templates = []
    for stage, view in enumerate(views):
        specs = chakra.chakra_nodes(view, table.ids)
        header = chakra.global_metadata(view, config.name, level, notes, any(s.duration_micros for s in specs))
        if stage == 0:  # rank 0 is stage 0's representative: its nodes as they are
            rank0 = (chakra.global_metadata(types.SimpleNamespace(graph={**view.graph, "rank": 0}), config.name,
                                            level, notes, any(s.duration_micros for s in specs)), specs)
        del header.attr[[a.name for a in header.attr].index("rank")]
        templates.append(StageTemplate(specs, header, table))
    total = 0
    with atomic_output_dir(out_dir, force=force) as tmp:
        chakra._write_json_form(tmp / "tensor_trace_chakra.json", *rank0)
        for rank in _ranks(world, progress):
            with open(tmp / f"{config.name}.{rank}.et", "wb") as f:
                total += templates[mesh.coords(rank)[1]].write(f, rank)
        (tmp / "comm_groups.json").write_text(json.dumps({str(i): list(g) for g, i in table.ids.items()}))
        summary = summarize(workload, views, level)
        summary.update(et_bytes=total, comm_groups=len(table.ids), notes=notes)
        (tmp / "summary.json").write_text(json.dumps(summary, indent=1))
    return {**summary, "dir": str(out_dir), "prefix": str(Path(out_dir) / config.name)}


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
        nodes = graph._node.values()  # networkx's own dict: 10^5 nodes, several passes
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
        layers = plan.stage(workload.config, s).layers
        stages.append({
            "stage": s, "layers": [layers[0], layers[-1]],
            "ranks": [r for r in range(mesh.world_size) if mesh.coords(r)[1] == s],
            "flops": flops,
            "compute_bytes": sum(d["bytes_read"] + d["bytes_written"] for d in ops),
            "comm_bytes": sum(d["bytes"] for d in comms),
            "comm": {k: {"count": n, "bytes": b} for k, (n, b) in sorted(by_kind.items())},
            "ops": len(ops), "chakra_nodes": sum(1 for d in view._node.values() if d["kind"] != "tensor"),
            "compute_us": sum(d.get("duration_us", 0.0) for d in ops),
            "comm_us": sum(d.get("duration_us", 0.0) for d in comms),
            "schedule": graph.graph["pipeline_schedule"],
        })
    return {"model": workload.config.name, "plan": asdict(plan), "world_size": mesh.world_size, "level": level,
            "hw_config": workload.hw_name, "distinct_rank_traces": len(stages),
            "traced_stages": workload.traced_stages,
            "rank_layout": "rank = ((dp_idx * pp) + pp_stage) * tp + tp_rank", "stages": stages}
