"""Probes of a stage with fewer layers, for predictions (`syntorch trace --predict_only`).

A stage's layers of one kind (the same block: dense or MoE MLP, the same attention window and stated routing
load) run the same ops on the same shapes, and in a step each one's nodes -- its period: its ops, the
collectives it issues (TP, CP, EP, FSDP's gathers and reduce-scatters, the DP buckets overlap launches) and
their tensors -- read the period before as that one read its own predecessor's. Only the first and the last
layer a step meets of a run differ (what comes before and after them is no layer: an FSDP gather is
prefetched for the next unit). So each run of alike layers is probed with its first four layers (more
under FSDP with full recomputation: `kept_per_run`), and a step of the whole stage is that probe's step
with the third period it meets repeated for the run's other layers (`expand_step`: a copy reads the copy
before it where the third read the second), which simulate/steps.py then simulates like a probed step.
The second and third periods must run the same ops, else the stage is probed whole.

What the end of the last backward does is not layer by layer: DDP/ZeRO buckets launched or copied back
together, their shards joined, sequence parallel's LayerNorm gradients summed over TP in one all-reduce. So
that end is the whole stage's, traced on its own with the optimizer step (training.probe_optimizer: every
gradient accumulated beforehand, as backward would, so overlap has launched its buckets), and put in place of
the probe's own (`_with_end`): the buckets it reads the reduced gradients of are those the expanded step
launched, which must be the whole stage's (else the stage is probed whole). With overlap, buckets follow the
layers when every layer holds a parameter at least a bucket large, as every layer of a large model does.
FSDP ends unit by unit, inside the periods. The optimizer step does not grow layer by layer either (its
multi-tensor kernels launch per chunk of tensors). tests/trace/test_layer_probe.py checks the prediction
against probing every layer.

Cost probes run two micro-batches (training.COST_MICROBATCHES): the first backward creates the gradients, the
last adds to them and synchronises them. A middle backward (accumulation, no sync) is the last one without
the nodes of its gradient sync, which the probe records (`middle_steps`), expanded like any other step.
"""
import dataclasses
import functools
from dataclasses import dataclass

from syntorch.config import ModelConfig
from syntorch.models import LAYER_PATH
from syntorch.parallel import pipeline as pp_
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.graph import TraceGraph
from syntorch.trace.training import layer_kind, probe_optimizer, probe_stage

MIDDLE = "middle"  # the micro-batch in the key of a middle backward derived from the last (middle_steps)


@dataclass(frozen=True)
class KeptLayers(TrainPlan):
    """The plan, but stage `kept[0]` holds only the chunks `kept[1]` (each a tuple of layer indices)."""
    kept: tuple = ()

    def stage(self, config: ModelConfig, index: int) -> pp_.Stage:
        full = super().stage(config, index)
        if not self.kept or index != self.kept[0]:
            return full
        chunks = self.kept[1]
        return pp_.Stage(index, self.pp, tuple(i for chunk in chunks for i in chunk), chunks if full.chunks else ())


class StageProbe(tuple):
    """A stage's probe, which unpacks as trace/training.py's probe_stage result (graph, where each step's
    nodes are); when layers were left out, `runs` says which: (chunk, kept layers, copies) for each run of
    alike layers the probe kept some of (kept_per_run), `copies` being how many more the stage has;
    `optimizer` is the whole stage's end of backward and optimizer step probed on their own ((graph, blocks),
    probe_optimizer's) and `finish` the node where the probe's own end of backward starts (None: FSDP's, kept);
    `middles` the middle backwards a probe of two micro-batches lacks (middle_steps); `periods` ({step key:
    _periods of each of its chunk's runs}, set by with_end) spares expanded_step the scan."""

    def __new__(cls, graph, blocks: dict, runs: list | None = None, optimizer: tuple | None = None,
                finish: int | None = None, middles: dict | None = None):
        probe = super().__new__(cls, (graph, blocks))
        probe.runs, probe.optimizer, probe.finish, probe.periods = runs or [], optimizer, finish, {}
        probe.middles = middles or {}
        return probe

    @property
    def graphs(self) -> list:
        """Every graph whose nodes need durations for a prediction."""
        return [self[0], *(middle[0] for middle in self.middles.values() if middle),
                *([self.optimizer[0]] if self.optimizer else [])]


def middle_steps(graph: TraceGraph, blocks: dict, syncs: list) -> dict:
    """The middle backwards (accumulation after accumulation) a probe of two micro-batches lacks, one per
    chunk: {chunk: (graph, {("B", MIDDLE, chunk): (first node, end)})}, the chunk's last backward without what
    only the last runs (`syncs`, probe_stage's: bucket launches, the end of backward), node for node the
    middle a probe of three traces (tests/plan/test_two_probes.py); None where the last runs nothing more.
    Its own graph, its nodes their own dicts: under the fused profile an op's kernel depends on what ran
    before it (trace/kernels.py), so durations are filled on it apart."""
    if 1 + max(key[1] for key in blocks if key[0] == "F") != 2:
        return {}
    gone = {n for start, end in syncs for n in range(start, end)}
    middles = {}
    for (kind, m, chunk), (start, end) in blocks.items():
        if kind == "B" and m == 1:
            nodes = [n for n in range(start, end) if n not in gone]
            middles[chunk] = _own_step(graph, nodes, ("B", MIDDLE, chunk)) if len(nodes) < end - start else None
    return middles


def _own_step(graph: TraceGraph, nodes: list[int], key: tuple) -> tuple[TraceGraph, dict]:
    """`nodes` (a step's) in a graph of their own after the tensors they read from outside (durations need
    their shapes), as a probe of that one step `key`."""
    inside = set(nodes)
    outside = sorted({u for v in nodes for u in graph.preds[v] if u not in inside
                      and graph.node_attrs[u]["kind"] == "tensor"})
    order = [*outside, *nodes]
    index = {n: i for i, n in enumerate(order)}
    out = TraceGraph(**graph.graph)
    out.append([dict(graph.node_attrs[n]) for n in order],
               ((index[u], index[v], e) for v in order for u, e in graph.preds[v].items() if u in index), copy=False)
    return out, {key: (len(outside), len(order))}


def runs(config: ModelConfig, layers, load=None) -> list[list[int]]:
    """`layers` cut into runs of consecutive layers of one kind (`load`: TrainPlan.moe_load)."""
    out = []
    for i in layers:
        if out and layer_kind(config, out[-1][-1], load) == layer_kind(config, i, load):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def reduced(config: ModelConfig, plan: TrainPlan, stage: int) -> tuple | None:
    """(the chunks of layers a probe keeps, the runs it stands for as StageProbe.runs), or None when every
    run of alike layers is at most kept_per_run long, or the first forward gathers every ZeRO bucket
    (overlap_param_gather), or experts and dense parameters have buckets of their own (EP without FSDP)."""
    full, keep = plan.stage(config, stage), kept_per_run(plan)
    chunks = [runs(config, chunk, plan.moe_load) for chunk in (full.chunks or (full.layers,))]
    long = [(c, tuple(run[:keep]), len(run) - keep) for c, chunk in enumerate(chunks) for run in chunk
            if len(run) > keep]
    if not long or (plan.zero != 3 and (plan.ep > 1 or (plan.zero and plan.overlap_param_gather))):
        return None
    return tuple(tuple(i for run in chunk for i in run[:keep]) for chunk in chunks), long


def kept_per_run(plan: TrainPlan) -> int:
    """Layers a probe keeps of each run: four (the first and the last a step meets, two alike periods between).
    Under FSDP with full recomputation the fused profile fuses the backward of the second-last layer a step
    meets otherwise (Llama's RMSNorm backward pow joins another kernel only there), and in an interleaved
    chunk's first backward the third-last's too: five, six when interleaved, so the second and third periods
    (those compared and repeated) are middle ones. With fewer, such stages were probed whole after a kept
    probe, or with the fused profile `trace --predict_only` failed."""
    if plan.zero == 3 and plan.recompute == "full":
        return 6 if plan.virtual_stages > 1 else 5
    return 4


def layer_probe(config: ModelConfig, plan: TrainPlan, stage: int, dtype, microbatches: int,
                rank: int | None = None) -> StageProbe:
    """The stage probed with kept_per_run layers per run of alike layers, or whole when that cannot stand for it
    (`rank`: the stage's rank probed, default its representative)."""
    cut = reduced(config, plan, stage)
    kept = cut and kept_probe(config, plan, stage, dtype, microbatches, cut, rank)
    probe = kept and with_end(kept, cut[1], probe_optimizer(config, plan, stage, dtype, rank), plan.mesh)
    return probe or whole_probe(config, plan, stage, dtype, microbatches, rank)


def kept_probe(config: ModelConfig, plan: TrainPlan, stage: int, dtype, microbatches: int,
               cut: tuple, rank: int | None = None) -> StageProbe | None:
    """The probe of the layers `cut` (reduced's) keeps, without the whole stage's end; None when a run's
    second and third periods differ."""
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.init}
    syncs = []
    graph, blocks = probe_stage(config, KeptLayers(**fields, kept=(stage, cut[0])), stage, dtype, rank,
                                microbatches=microbatches, syncs=syncs)
    middles = middle_steps(graph, blocks, syncs)
    steps = [(graph, key, *span) for key, span in blocks.items() if key[0] != "optimizer"] + \
        [(middle, key, *span) for middle, middle_blocks in filter(None, middles.values())
         for key, span in middle_blocks.items()]
    if not all(_periods(g, start, end, run) for g, key, start, end in steps for run in cut[1] if run[0] == key[2]):
        return None
    # the end of backward is the last span of syncs (train_step's gradient sync `finish`)
    return StageProbe(graph, blocks, cut[1], None, syncs[-1][0] if syncs and plan.zero != 3 else None, middles)


def with_end(kept: StageProbe, runs: list, optimizer: tuple, mesh) -> StageProbe | None:
    """`kept` standing for `runs` (StageProbe.runs), with the whole stage's end of backward and optimizer step
    (probe_optimizer's); None when the buckets that end reads are not those its expanded last backwards
    launch (in number, shape, type and order): with overlap, each chunk's last backward launches its own
    (an interleaved stage's other chunks before the one the end follows), else the end launches them all."""
    probe = StageProbe(*kept, runs, optimizer, kept.finish, kept.middles)
    probe.periods = _expandable(probe)
    if probe.periods is None:
        return None
    if kept.finish is None:
        return probe
    graph, blocks = kept
    group, last = grad_group(graph, mesh), max(key[1] for key in blocks if key[0] == "B")
    launched = [bucket for key, (start, end) in blocks.items() if key[:2] == ("B", last) and start <= kept.finish
                for bucket in _launched(graph, start, min(end, kept.finish), [r for r in runs if r[0] == key[2]],
                                        probe.periods[key], group)]
    whole = optimizer[0]
    return probe if launched == [_kind(whole.node_attrs[n]) for n in _flats(whole, optimizer[1])] else None


def _expandable(probe: StageProbe) -> dict | None:
    """{step key: _periods of each of its chunk's runs} when each step of `probe` holds them where
    expanded_step will look for them (up to the probe's end of backward in the step it starts in), else None.
    kept_probe checked the steps where it traced them; a probe moved to another layout and cut at its end of
    backward (ProbeCache) may not hold them: an FSDP stage of Llama-3.1 405B (TP8 PP4 CP2, no SP) did not."""
    periods = {}
    for graph, blocks in [probe, *filter(None, probe.middles.values())]:
        for key, (start, end) in blocks.items():
            if key[0] == "optimizer":
                continue
            if graph is probe[0] and probe.finish is not None and start <= probe.finish < end:
                end = probe.finish
            periods[key] = [_periods(graph, start, end, run) for run in probe.runs if run[0] == key[2]]
            if not all(periods[key]):
                return None
    return periods


def _launched(graph: TraceGraph, start: int, end: int, runs: list, periods: list, group: list[int]) -> list[tuple]:
    """What each bucket collective (over `group`) of nodes [start, end) writes, in order, as expand_step
    repeats their runs' periods (`periods`: _periods of each run there)."""
    repeats = {}
    for run, (_, first, second) in zip(runs, periods):
        repeats[second] = first, run[2]
    out = []
    for n in range(start, end):
        out += _written(graph, n, group)
        if n in repeats:
            first, copies = repeats[n]
            out += [w for m in range(first + 1, n + 1) for w in _written(graph, m, group)] * copies
    return out


def _written(graph: TraceGraph, n: int, group: list[int]) -> list[tuple]:
    """[what node n writes] if it is a collective over `group`, else []."""
    d = graph.node_attrs[n]
    if d["kind"] != "collective" or sorted(d["group"]) != group:
        return []
    return [_kind(graph.node_attrs[next(v for v in graph.succs[n] if graph.node_attrs[v]["kind"] == "tensor")])]


def _kind(d: dict) -> tuple:
    return tuple(d["shape"]), d["dtype"]


def _flats(whole: TraceGraph, blocks: dict) -> list[int]:
    """The reduced buckets probe_optimizer's end of backward reads (grad_sync.flat.<k>), in bucket order."""
    end = blocks[("optimizer", None, None)][0]
    return [n for _, n in sorted((int(d["name"].rsplit(".", 1)[1]), n) for n, d in whole.node_attrs.items()
                                 if n < end and d["kind"] == "tensor" and d["name"].startswith("grad_sync.flat."))]


def grad_group(graph: TraceGraph, mesh) -> list[int]:
    """The ranks the probed rank averages gradients over."""
    return mesh.group(graph.graph["rank"], "dp", "cp")


def whole_probe(config: ModelConfig, plan: TrainPlan, stage: int, dtype, microbatches: int,
                rank: int | None = None) -> StageProbe:
    syncs = []
    graph, blocks = probe_stage(config, plan, stage, dtype, rank, microbatches=microbatches, syncs=syncs)
    return StageProbe(graph, blocks, middles=middle_steps(graph, blocks, syncs))


def expand_step(graph: TraceGraph, start: int, end: int, runs: list, first: tuple | None = None) -> TraceGraph:
    """Nodes [start, end) of `graph` (one step; what they read from outside it left out) with each run's
    third period repeated `copies` times after it (runs: StageProbe.runs of the step's chunk; `first`: the
    first run's _periods there, when known). The step shares the probe's node and edge dicts (a copy per
    node would cost as much as simulating it): it is read, never written."""
    if not runs:
        return _step_only(graph, start, end)
    for run in runs:  # each a copy of nodes [start, end) (the first of the graph's, the others of the last copy)
        graph = _repeat(graph, start, end, *(first or _periods(graph, start, end, run)), run[2])
        start, end, first = 0, len(graph), None
    return graph


def expanded_steps(probe: StageProbe, grad_group: list[int]):
    """(key, expanded_step) of every step of a probe that left layers out, but the optimizer's, one at a time
    (a whole stage's step of a large model holds ~10^5 nodes: a caller keeps one at a time)."""
    for key in probe[1]:
        if key[0] != "optimizer":
            yield key, expanded_step(probe, key, grad_group)


def middle_step(probe: StageProbe, chunk: int) -> tuple[TraceGraph, int, int]:
    """(graph, first node, end) of the chunk's middle backward (StageProbe.middles, not None) as the whole
    stage runs it (expand_step)."""
    graph, blocks = probe.middles[chunk]
    key = ("B", MIDDLE, chunk)
    start, end = blocks[key]
    runs = [run for run in probe.runs if run[0] == chunk]
    if not runs:
        return graph, start, end
    step = expand_step(graph, start, end, runs, (probe.periods.get(key) or [None])[0])
    return step, 0, len(step)


def expanded_step(probe: StageProbe, key: tuple, grad_group: list[int]) -> TraceGraph:
    """The probe's step `key` as the whole stage runs it: expand_step, and where the probe's end of backward
    starts, the whole stage's instead (`_with_end`). `grad_group`: the ranks gradients are averaged over."""
    graph, (start, end) = probe[0], probe[1][key]
    runs = [run for run in probe.runs if run[0] == key[2]]
    first = (probe.periods.get(key) or [None])[0]
    if probe.finish is None or not start <= probe.finish < end:
        return expand_step(graph, start, end, runs, first)
    return _with_end(expand_step(graph, start, probe.finish, runs, first), *probe.optimizer, grad_group)


def _with_end(step: TraceGraph, whole: TraceGraph, blocks: dict, grad_group: list[int]) -> TraceGraph:
    """`step` (a new graph) followed by probe_optimizer's end of backward (`whole`'s nodes before the
    optimizer's block), each reduced bucket the step launched read there as written by the step's bucket
    collective (over `grad_group`) of its place: the last buckets (with_end checked they are alike). Those an
    interleaved stage's other chunks launched in their own last backward are read from outside the step,
    as in a probe of every layer."""
    flats = _flats(whole, blocks)
    written = [(n, next(v for v in step.succs[n] if step.node_attrs[v]["kind"] == "tensor"))
               for n, d in step.collectives() if sorted(d["group"]) == grad_group]
    assert len(written) <= len(flats), "the end of backward reads other buckets than the step launched"
    base, end = len(step), blocks[("optimizer", None, None)][0]
    step.append((whole.node_attrs[n] for n in range(end)),
                ((base + u, base + v, e) for v in range(end) for u, e in whole.preds[v].items()), copy=False)
    step.append((), ((n, base + f, step.succs[n][t]) for (n, t), f in zip(written, flats[len(flats) - len(written):])),
                copy=False)
    return step


def _step_only(graph: TraceGraph, start: int, end: int) -> TraceGraph:
    out = TraceGraph(**graph.graph)
    out.append((graph.node_attrs[n] for n in range(start, end)),
               ((u - start, v - start, e) for v in range(start, end) for u, e in graph.preds[v].items() if u >= start),
               copy=False)
    return out


def _periods(graph: TraceGraph, start: int, end: int, run: tuple) -> tuple[int, int, int] | None:
    """The ends of the first, second and third period of the run's kept layers in nodes [start, end),
    in the order the step meets them: each period runs from after the one before to its layer's last op or
    collective and that one's outputs. None when the second and third do not run the same ops, or the
    step lacks them."""
    last, nodes = {}, graph.node_attrs
    for n in range(start, end):
        d = nodes[n]
        layer = _layer_of(d.get("module") or "") if d["kind"] != "tensor" else None
        if layer in run[1]:
            last[layer] = n
    if len(last) < len(run[1]):
        return None
    before, first, second, *_ = sorted(_outputs_end(graph, n, end) for n in last.values())
    if [_role(graph.node_attrs[n]) for n in range(before + 1, first + 1)] != \
            [_role(graph.node_attrs[n]) for n in range(first + 1, second + 1)]:
        return None
    return before, first, second


@functools.cache
def _layer_of(module: str) -> int | None:
    """The layer a module path is in (None: none); a probe's few thousand paths are matched once."""
    match = LAYER_PATH.match(module)
    return int(match.group(1)) if match else None


def _outputs_end(graph: TraceGraph, op: int, end: int) -> int:
    """The last of the tensor nodes right after node `op` that it wrote."""
    n = op
    while n + 1 < end and graph.node_attrs[n + 1]["kind"] == "tensor" and op in graph.preds[n + 1]:
        n += 1
    return n


def _role(d: dict) -> tuple:
    """What a node does, whichever layer it is in."""
    if d["kind"] == "tensor":
        return "tensor", tuple(d["shape"]), d["dtype"]
    module = LAYER_PATH.sub("layers", d.get("module") or "")
    if d["kind"] == "op":
        return "op", d["name"], module, d.get("duration_us")
    return "collective", d["collective"], module, d["bytes"], len(d["group"]), d.get("duration_us")


def _repeat(graph: TraceGraph, start: int, end: int, before: int, first: int, second: int, copies: int) -> TraceGraph:
    """Nodes [start, end) of `graph` (numbered from 0, what they read from outside left out) with the nodes
    (first, second] (a period) followed by `copies` copies of themselves: each copy reads the one before it
    where the period read (before, first], the period before it; what follows reads the last copy (and the
    one before it) where it read the period (and the one before)."""
    size = second - first
    out = TraceGraph(**graph.graph)
    nodes, pred = graph.node_attrs, graph.preds
    period, after = range(first + 1, second + 1), range(second + 1, end)
    edges = [(u - start, v - start, e) for v in range(start, second + 1) for u, e in pred[v].items() if u >= start]
    # the period's in-edges, numbered from 0, each marked whether it moves with the copy (read from after `before`)
    inner = [(u - start, u > before, v - start, e) for v in period for u, e in pred[v].items() if u >= start]
    for shift in range(size, (copies + 1) * size, size):
        edges += [(u + shift if moves else u, v + shift, e) for u, moves, v, e in inner]
    shift = copies * size
    edges += [(u - start + (shift if u > before else 0), v - start + shift, e)
              for v in after for u, e in pred[v].items() if u >= start]
    out.append([*(nodes[n] for n in range(start, second + 1)), *(nodes[n] for _ in range(copies) for n in period),
                *(nodes[n] for n in after)], edges, copy=False)
    return out
