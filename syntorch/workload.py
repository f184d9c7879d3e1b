"""`syntorch trace`: a training step of a TP x PP x DP (ZeRO, SP) plan as per-rank Chakra traces.

    workload = trace_workload(config, plan, hw=load_hw_config("h100-sxm"))
    summary = write_workload(workload, "runs/g175-256", level="module")

Steps: trace each pipeline stage once on meta (trace/training.py) -> durations from the hardware config ->
Chakra nodes of each stage's representative rank (chakra/nodes.py) -> every rank's file from its stage's
nodes, serialized once, with only what differs per rank patched in (chakra/writer.py's StageTemplate): the
comm-group id of each communication node and the peer of each send and recv. Comm-group ids are those of
every process group of the plan's mesh (parallel/mesh.py), numbered by chakra/groups.py. Under a routing
load that makes EP ranks differ (--moe_load, parallel/moe_load.py's RankKinds), each stage is traced once
per rank kind, and every rank's file is made from its kind's nodes the same way. A middle stage that is a
shifted copy of the same traced stage as the stage before it, in the same schedule, is not scheduled and
viewed again: its view is that stage's moved (_stage_view; 11 of a 16-stage Llama-3.1 405B plan's). Any other
shifted copy is scheduled and viewed as its traced stage, in the copy's own schedule, and then moved
(StageGraphs.kind_view): no shifted op graph is made, and one probe's prepared steps serve every copy.
"""
import json
import types
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from syntorch.chakra.groups import comm_groups_json, group_ids
from syntorch.chakra.nodes import chakra_nodes, global_metadata, rewrite_notes
from syntorch.chakra.writer import GroupIds, StageTemplate, write_json_form
from syntorch.config import ModelConfig
from syntorch.hardware import HardwareConfig
from syntorch.outdir import atomic_output_dir
from syntorch.parallel import memory
from syntorch.parallel.mesh import ORDER
from syntorch.parallel.moe_load import RankKinds, rank_kinds
from syntorch.parallel.plans import TrainPlan
from syntorch.simulate.chakra_files import RANK_KINDS, rank_kinds_json
from syntorch.simulate.prediction import TIMELINE, Prediction
from syntorch.trace.cost import fill_durations, set_durations
from syntorch.trace.graph import TraceGraph, no_gc
from syntorch.trace.layer_probe import StageProbe, layer_probe, whole_probe
from syntorch.trace.levels import level_view
from syntorch.trace.step_schedule import schedule_stage, stage_steps
from syntorch.trace.step_views import StepViews, scheduled_view
from syntorch.trace.training import (COST_MICROBATCHES, PROBE_MICROBATCHES, probe_stage, shift_stage, shift_view,
                                     traced_stage_for)


@dataclass
class Workload:
    config: ModelConfig
    plan: TrainPlan
    stages: Sequence[TraceGraph]  # per pipeline stage its representative rank's training step (StageGraphs)
    hw: HardwareConfig | None = None  # what the durations are from
    traced_stages: int = 0  # stages actually run under the tracer (the others are shifted copies)
    probes: dict = field(default_factory=dict)  # traced stage -> its StageProbe (graph, steps): what predictions use
    source: list[int] = field(default_factory=list)  # stage -> the traced stage it is a copy of
    profile: str = "eager"  # software profile of the durations, when hw is set
    attention: str = "flash"  # the attention kernel of the durations (trace/kernels.py), when hw is set
    memory: list[dict] = field(default_factory=list)  # per stage: parallel/memory.py's estimate of one rank
    kinds: RankKinds | None = None  # the rank kinds of each stage (moe_load.py; one under a uniform load)
    kind_probes: dict = field(default_factory=dict)  # with more than one kind: (traced stage, kind) -> its probe


def trace_workload(config: ModelConfig, plan: TrainPlan, dtype=torch.bfloat16,
                   hw: HardwareConfig | None = None, schedule: bool = True, profile: str = "eager",
                   attention: str = "flash", layer_probes: bool = True) -> Workload:
    """`schedule=False`: only the probes (enough to predict, syntorch/simulate), no stage's whole step; with
    `layer_probes` each probe keeps a few layers (layer_probe.kept_per_run) of each run of alike layers,
    else every layer. `profile`, `attention`: the software of the durations (trace/kernels.py), with `hw`."""
    with no_gc():
        return _trace_workload(config, plan, dtype, hw, schedule, (profile, attention), layer_probes)


def _trace_workload(config, plan, dtype, hw, schedule, software, layer_probes) -> Workload:
    estimates = [memory.estimate(config, plan, dtype, s) for s in range(plan.pp)]
    if hw:  # before the work: a plan that does not fit is refused, not traced
        memory.check_fits(estimates, hw.memory_gb, hw.name, plan.zero)
    source, kinds = traced_stage_for(config, plan), rank_kinds(plan.mesh, plan.moe_load)
    traced = [(s, k) for s in sorted(set(source)) for k in range(kinds.count)]  # one rank per stage and kind
    if not schedule:  # a prediction needs only the probes, costed
        probe = layer_probe if layer_probes else whole_probe
        probes = {key: probe(config, plan, key[0], dtype, COST_MICROBATCHES, rank=kinds.representative(*key))
                  for key in traced}
        for graph in (graph for probe in probes.values() for graph in probe.graphs) if hw else ():
            fill_durations(graph, hw, *software)
        return _workload(config, plan, [], hw, probes, source, software, estimates, kinds)
    # copies need one more micro-batch than costs do
    probes = {key: StageProbe(*probe_stage(config, plan, key[0], dtype, kinds.representative(*key),
                                           microbatches=PROBE_MICROBATCHES)) for key in traced}
    for graph, _ in probes.values() if hw else ():
        fill_durations(graph, hw, *software)  # before scheduling: a copied node keeps its duration
    stages = StageGraphs(config, plan, probes, source, hw, software)
    return _workload(config, plan, stages, hw, probes, source, software, estimates, kinds)


def _workload(config, plan, stages, hw, probes, source, software, estimates, kinds) -> Workload:
    """`probes` by (stage, kind): Workload.probes holds kind 0's by stage, kind_probes all when several."""
    return Workload(config, plan, stages, hw, len(set(source)), {s: p for (s, k), p in probes.items() if k == 0},
                    source, *software, estimates, kinds, probes if kinds.count > 1 else {})


class StageGraphs(Sequence):
    """Workload.stages: each stage's scheduled graph (its representative's training step), made from its
    probe when asked for and not kept, so that one stage's whole step is alive at a time (write_workload);
    `kind_graph` makes any rank kind's of a stage."""

    def __init__(self, config, plan, probes, source, hw, software):
        self.config, self.plan, self.probes, self.source, self.hw, self.software = \
            config, plan, probes, source, hw, software
        self._steps = {}  # (traced stage, kind) -> its probe's steps as prepared for copying to another stage
        self._views = {}  # (traced stage, kind, level, shifted) -> its probe's StepViews

    def __len__(self) -> int:
        return self.plan.pp

    def __getitem__(self, s: int) -> TraceGraph:
        if not 0 <= s < self.plan.pp:
            raise IndexError(s)
        return self.kind_graph(s, 0)

    def kind_graph(self, s: int, kind: int, share: bool = False) -> TraceGraph:
        """Stage s's graph as its rank kind `kind`'s representative runs it (probes: by (stage, kind)); `share`:
        schedule_stage's, for a graph that is read and dropped."""
        traced, (graph, blocks) = self.source[s], self.probes[self.source[s], kind]
        if traced != s:
            graph = self._recosted(shift_stage(graph, self.plan.mesh, s, self._layer_offset(s, traced)))
        return schedule_stage(graph, blocks, self.plan, keep=traced == s, share=share)

    def kind_view(self, s: int, kind: int, level: str) -> tuple[TraceGraph, dict]:
        """level_view(kind_graph(s, kind), level) and its stage_figures; for a shifted copy, made as for its
        traced stage in the copy's schedule (schedule_stage's `stage`) and then moved (moved_view), with the
        probe's steps as prepared for copying kept for the next copy. A module or layer view is made from
        views of the probe's steps (step_views.py) where it can be, without the scheduled op graph."""
        traced = self.source[s]
        made = self._step_view(s, kind, level) if level != "op" else None
        if made:
            return made if traced == s else self.moved_view(*made, s)
        if traced == s:
            graph = self.kind_graph(s, kind, share=True)
            return level_view(graph, level), stage_figures(graph)
        steps = self._steps.setdefault((traced, kind), {})
        graph = schedule_stage(*self.probes[traced, kind], self.plan, keep=True, stage=s, steps=steps, share=True)
        return self.moved_view(level_view(graph, level), stage_figures(graph), s)

    def _step_view(self, s: int, kind: int, level: str) -> tuple[TraceGraph, dict] | None:
        """step_views.scheduled_view of stage s (as kind_view makes it) and its figures, or None."""
        traced, (probe, blocks) = self.source[s], self.probes[self.source[s], kind]
        shifted = traced != s  # (then scheduled as kind_view schedules it: its inputs in another order)
        if (traced, kind, level, shifted) not in self._views:
            self._views[traced, kind, level, shifted] = StepViews(probe, level, shifted)
        made = scheduled_view(self._views[traced, kind, level, shifted], blocks, self.plan, s if shifted else None,
                              self._steps.setdefault((traced, kind), {}) if shifted else None)
        return made and (made[0], node_figures(made[1], made[0].graph["pipeline_schedule"]))

    def moved_view(self, view: TraceGraph, figures: dict, s: int) -> tuple[TraceGraph, dict]:
        """A view of a shifted copy of a stage moved to stage s (training.shift_view), its collectives costed
        again where they are now (as kind_graph costs them), and its figures with the moved collectives' time."""
        view = shift_view(view, self.plan.mesh, s, self._layer_offset(s, view.graph["stage"]))
        collectives = list(view.collectives())  # (one pass over the view's nodes for both)
        self._recosted(view, collectives)
        return view, {**figures, "comm_us": sum(d.get("duration_us", 0.0) for _, d in collectives)}

    def _layer_offset(self, s: int, traced: int) -> int:
        return self.plan.stage(self.config, s).layers[0] - self.plan.stage(self.config, traced).layers[0]

    def _recosted(self, graph: TraceGraph, collectives=None) -> TraceGraph:
        """`graph` with its collectives (`collectives`: those, when listed) costed where they are now: a moved
        group may span nodes where the source's did not."""
        if self.hw:
            set_durations(graph, graph.collectives() if collectives is None else collectives, {}, self.hw,
                          *self.software)
        return graph


def write_workload(workload: Workload, out_dir, level: str = "module", force: bool = False,
                   progress: bool = True, prediction: Prediction | None = None) -> dict:
    """Every rank's `<model>.<rank>.et`, `comm_groups.json`, `tensor_trace_chakra.json` (rank 0), the rank
    kinds `syntorch predict` reads (simulate/chakra_files.py) and `summary.json` (with the prediction and its
    timeline when given) into `out_dir`, whole or not at all. Returns the summary."""
    with no_gc():
        return _write_workload(workload, out_dir, level, force, progress, prediction)


def _write_workload(workload, out_dir, level, force, progress, prediction) -> dict:
    config, plan, kinds = workload.config, workload.plan, workload.kinds
    mesh, world = plan.mesh, plan.mesh.world_size
    ids = group_ids(ranks for _, ranks in mesh.process_groups(config.tied_head))
    groups = GroupIds(ids, mesh)
    # the stages' collectives are theirs
    notes = rewrite_notes(graph for graph, _ in (workload.kind_probes or workload.probes).values())
    by_kind = {}  # (stage, kind) -> its ranks
    for rank in range(world):
        by_kind.setdefault((mesh.coordinate(rank).pp, kinds.of(rank)), []).append(rank)
    figures, total, variants = {}, 0, 0
    with atomic_output_dir(out_dir, force=force) as tmp:
        last = None  # the stage, kind, view and figures made last
        for (stage, kind), ranks in _progress(sorted(by_kind.items()), world, progress):
            # one template alive at a time: its graph, view and nodes, then its ranks' files (the view before
            # is kept only to be moved here)
            last = last if last and _moves_to(workload, last[:2], (stage, kind)) else None
            last = stage, kind, *_stage_view(workload, stage, kind, level, last)
            template, figures[stage, kind], rank0 = _template(workload, stage, kind, groups, notes, level, *last[2:])
            if rank0:
                write_json_form(tmp / "tensor_trace_chakra.json", *rank0)
            written, differ = template.write(f"{tmp}/{config.name}", ranks)
            total, variants = total + written, variants + differ
            del template, rank0
        (tmp / "comm_groups.json").write_text(comm_groups_json(ids))
        (tmp / RANK_KINDS).write_text(rank_kinds_json(config.name, mesh, tmp, workload.hw, workload.profile,
                                                       workload.attention, kinds.groups))
        summary = summarize(workload, figures, level)
        summary.update(et_bytes=total, comm_groups=len(ids), notes=notes, distinct_rank_traces=variants)
        if prediction is not None:
            summary["predicted"] = prediction.summary
            prediction.write_timeline(tmp / TIMELINE)
        (tmp / "summary.json").write_text(json.dumps(summary, indent=1))
    return {**summary, "dir": str(out_dir), "prefix": str(Path(out_dir) / config.name)}


def _template(workload, stage: int, kind: int, groups, notes, level, view,
              figures) -> tuple[StageTemplate, dict, tuple | None]:
    """The StageTemplate of a stage's rank kind (every rank of the kind is written from it) from its `view` at
    `level`, its figures (stage_figures, with its Chakra node count) and, for rank 0 (stage 0's
    representative), its header and nodes as they are."""
    specs = chakra_nodes(view, groups.ids, workload.kinds.p2p_all_to_all)
    timed = any(s.duration_micros for s in specs)
    header = global_metadata(view, workload.config.name, level, notes, timed)
    rank0 = None
    if stage == kind == 0:
        rank0 = global_metadata(types.SimpleNamespace(graph={**view.graph, "rank": 0}), workload.config.name,
                                level, notes, timed), specs
    del header.attr[[a.name for a in header.attr].index("rank")]
    template = StageTemplate(specs, header, groups, workload.kinds.representative(stage, kind))
    return template, {**figures, "chakra_nodes": len(specs)}, rank0


def _moves_to(workload, was: tuple, now: tuple) -> bool:
    """Is stage and kind `now`'s view the one of `was` moved (_stage_view)? When both stages are shifted
    copies of one traced stage, of one kind, and run one schedule."""
    (a, kind_a), (b, kind_b), source = was, now, workload.source
    return kind_a == kind_b and source[a] == source[b] and source[b] not in (a, b) \
        and stage_steps(workload.plan, a) == stage_steps(workload.plan, b)


def _stage_view(workload, stage: int, kind: int, level: str, last: tuple | None) -> tuple[TraceGraph, dict]:
    """A stage's rank kind's graph at `level` and its figures (stage_figures). `last`: the stage, kind, view
    and figures of a stage this one's view is moved from (_moves_to): then they are that view moved
    (StageGraphs.moved_view)."""
    if last:
        return workload.stages.moved_view(*last[2:], stage)
    return workload.stages.kind_view(stage, kind, level)


def _progress(kinds: list, world: int, progress: bool):
    if not progress:
        return kinds
    from rich.progress import track
    return track(kinds, description=f"writing {world} rank traces", transient=True)


def stage_figures(graph: TraceGraph) -> dict:
    """What summary.json says of a stage from its graph (every rank of a stage has the same figures): FLOPs,
    compute bytes, communication bytes by kind, op counts, the schedule."""
    return node_figures(graph.node_attrs.values(), graph.graph["pipeline_schedule"])


def node_figures(nodes, schedule: list[str]) -> dict:
    """stage_figures of a graph's nodes' attributes (in node order) and its pipeline schedule."""
    flops = dict.fromkeys(("forward", "backward", "optimizer"), 0)
    ops = compute_bytes = comm_bytes = compute_us = comm_us = 0
    by_kind = {}
    for d in nodes:  # one pass (10^4-10^5 nodes a stage), sums in node order
        if d["kind"] == "op":
            ops += 1
            if d["phase"] in flops:
                flops[d["phase"]] += d["flops"]
            compute_bytes += d["bytes_read"] + d["bytes_written"]
            compute_us += d.get("duration_us", 0.0)
        elif d["kind"] == "collective":
            count, nbytes = by_kind.get(d["collective"], (0, 0))
            by_kind[d["collective"]] = count + 1, nbytes + d["bytes"]
            comm_bytes += d["bytes"]
            comm_us += d.get("duration_us", 0.0)
    return {"flops": flops, "compute_bytes": compute_bytes, "comm_bytes": comm_bytes,
            "comm": {k: {"count": n, "bytes": b} for k, (n, b) in sorted(by_kind.items())},
            "ops": ops, "compute_us": compute_us, "comm_us": comm_us, "schedule": schedule}


FIGURES = ("flops", "compute_bytes", "comm_bytes", "comm", "ops", "chakra_nodes", "compute_us", "comm_us")


def summarize(workload: Workload, figures: dict, level: str) -> dict:
    """Per stage: its representative's figures (stage_figures, `figures` by (stage, kind)), its Chakra node
    count (as in the files), layers and ranks; under a load that makes rank kinds, each kind's figures too."""
    plan, mesh, kinds = workload.plan, workload.plan.mesh, workload.kinds
    stages = []
    for s in range(plan.pp):
        stage, figure = plan.stage(workload.config, s), figures[s, 0]
        stages.append({
            "stage": s, "layers": [stage.layers[0], stage.layers[-1]],
            "chunks": [[chunk[0], chunk[-1]] for chunk in stage.chunks or (stage.layers,)],
            "ranks": mesh.stage_ranks(s), **{k: figure[k] for k in FIGURES}, "schedule": figure["schedule"],
            "memory_bytes": workload.memory[s] if workload.memory else None,
        })
        if kinds.count > 1:
            stages[-1]["rank_kinds"] = [{"ep_ranks": group, "ranks": kinds.ranks(k),
                                         **{f: figures[s, k][f] for f in FIGURES}} for k, group in enumerate(kinds.groups)]
    return {"model": workload.config.name, "plan": asdict(plan), "world_size": mesh.world_size, "level": level,
            "hw_config": workload.hw.name if workload.hw else None, "profile": workload.profile,
            "attention": workload.attention, "traced_stages": workload.traced_stages, "kinds_per_stage": kinds.count,
            "all_to_all_as_p2p": kinds.p2p_all_to_all,
            "rank_layout": ORDER, "stages": stages}
