"""A training step traced on `meta`, one pipeline stage at a time.

Ranks that differ only in their DP, CP and TP index run the same ops on same-shaped shards with the same
collectives, over groups that are a translation of each other along the dp, cp and tp axes of the mesh (a CP
rank's chunks differ from another's in their positions only, values a meta trace does not hold). So each
stage is traced once, as its representative rank (dp 0, cp 0, tp 0), and every other rank's trace is the
representative's with global ranks mapped by `Mesh.translate` (tests trace every rank and compare). The one other
difference is which output of a split a TP rank reads under sequence parallel (its own part): same shapes,
same dependencies, other tensor ids, which Chakra keeps only as IOInfo text that simulators do not read.

Middle stages (neither first nor last) with as many layers run the same ops on other layers: the trace of
one is the other's with layer indices shifted and global ranks moved along pp (`shift_stage`, also tested).

Micro-batches repeat: a probe runs at most PROBE_MICROBATCHES of them (every kind of step: the first
backward creates the gradients, middle ones accumulate, the last one synchronises them) and the stage's
step is assembled from copies of the probed steps in the stage's own schedule (`schedule_stage`; tested
equal to running every micro-batch).

The schedule is part of the trace: a stage runs its steps (forward or backward of a micro-batch) one after
another, so the ops of a step that depend on nothing inside it get a dependency on the last node of the
step before, through a 0-byte `schedule` tensor (kept by every level and exporter, a data dep in Chakra).
"""
import bisect
import contextlib
import dataclasses

import torch

from syntorch.config import ModelConfig
from syntorch.models import LAYER_PATH, layer_path
from syntorch.nodynamo import plain_step
from syntorch.parallel import plans
from syntorch.parallel.distributed import symbolic_world
from syntorch.parallel.mesh import Mesh, init_groups
from syntorch.parallel.pipeline import schedule
from syntorch.trace.graph import TraceGraph, with_node_attrs
from syntorch.trace.meta_cache import MetaCache
from syntorch.trace.tracer import Tracer


PROBE_MICROBATCHES = 4  # enough to see every kind of step: first, middle (after a middle), and last backward
# what costing steps needs (syntorch/simulate): the first and the last backward; a middle one is the last
# without what only the last runs (probe_stage's `syncs`; layer_probe.middle_steps), and a middle backward
# after the first costs what one after a middle does (the same ops; only their tensors' versions differ,
# which copies must get right)
COST_MICROBATCHES = 2


def trace_stage(config: ModelConfig, plan: plans.TrainPlan, stage: int, dtype=torch.float32,
                rank: int | None = None, replicate: bool = True) -> TraceGraph:
    """The training step of one rank of `stage` (default: its representative) on meta, fake collectives.

    `replicate`: trace at most PROBE_MICROBATCHES micro-batches and assemble the step from their copies
    (`schedule_stage`); else run every micro-batch in the stage's schedule (tests compare the two)."""
    if replicate:
        return schedule_stage(*probe_stage(config, plan, stage, dtype, rank), plan)
    graph, blocks = _run_stage(config, plan, stage, dtype, rank)
    return _finish(graph, plan, list(blocks), [start for start, _ in blocks.values()])


def probe_stage(config, plan, stage, dtype=torch.float32, rank=None,
                microbatches: int = PROBE_MICROBATCHES, syncs: list | None = None) -> tuple[TraceGraph, dict]:
    """A short run of the stage -- at most `microbatches` of the plan's micro-batches, all forwards then all
    backwards (chunk by chunk under interleaving) -- and where each step's nodes are:
    {(kind, microbatch, chunk): (first node, end)}. `syncs` (a list): gets the spans [first node, end) of
    what only a chunk's last backward runs, in order: the gradient sync's bucket launches and, last, the end
    of backward (its `finish`). Without them a last backward is a middle one (accumulation after
    accumulation), node for node (tests/plan/test_two_probes.py): so COST_MICROBATCHES is two."""
    probe = dataclasses.replace(plan, microbatches=min(plan.microbatches, microbatches), schedule="gpipe")
    return _run_stage(config, probe, stage, dtype, rank, syncs=syncs)


def probe_optimizer(config: ModelConfig, plan: plans.TrainPlan, stage: int, dtype=torch.float32,
                    rank: int | None = None) -> tuple[TraceGraph, dict]:
    """The stage's end of backward and optimizer step on their own: no micro-batch runs; every gradient is
    accumulated first, untraced, as backward would (so overlap has launched its buckets; their reduced
    gradients are named grad_sync.flat.<bucket>); then the end of backward is traced (the nodes before the
    ("optimizer", None, None) block) and the optimizer step (that block)."""
    return _run_stage(config, dataclasses.replace(plan, schedule="gpipe"), stage, dtype, rank, microbatches=0)


def _accumulate_gradients(run: plans.StageRun, zero: int) -> None:
    """Every parameter's gradient accumulated in backward's order (the reverse of registration), so DDP/ZeRO's
    hooks see them as in the last backward; FSDP's and ZeRO's shards just hold one."""
    if zero != 3:
        run.grad_sync.active = True
        for p in reversed(list(run.model.parameters())):
            torch.autograd.backward(p, torch.zeros_like(p))
    for p in [*run.model.parameters(), *run.grad_sync.optimizer_params()]:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def _run_stage(config, plan, stage, dtype, rank, microbatches: int | None = None,
               syncs: list | None = None) -> tuple[TraceGraph, dict]:
    """`microbatches=0`: no step but the end of backward and the optimizer's, on gradients set beforehand.
    `syncs`: probe_stage's."""
    mesh = plan.mesh
    rank = mesh.representative(stage) if rank is None else rank
    meta = {"model": config.name, "tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "cp": plan.cp, "ep": plan.ep,
            "stage": stage,
            "sequence_parallel": plan.sp, "zero": plan.zero, "mode": plan.mode}
    with symbolic_world(rank, mesh.world_size), MetaCache():  # below the Tracer's modes, see meta_cache.py
        groups = init_groups(mesh, config.tied_head, only_mine=True)
        run = plans.apply_plans(config, plan, groups, "meta", dtype)
        run.optimizer.step = plain_step(run.optimizer)  # the same ops, without importing torch._dynamo
        batches = [(torch.zeros(plan.micro_batch_size, plan.seq, dtype=torch.long, device="meta"),) * 2
                   for _ in range(plan.microbatches if microbatches is None else microbatches)]
        # (each micro-batch its own tensors, like its own data)
        if not batches:
            _accumulate_gradients(run, plan.zero)
        steps = []
        with Tracer(run.model, rank=rank, world_size=mesh.world_size, meta=meta, default_phase=None) as tracer:
            _name_optimizer_state(tracer, run)
            if syncs is not None:
                _mark_syncs(run.grad_sync, tracer.graph, syncs)
            # what lives across the step first, so every step's nodes look alike wherever it runs
            # (FSDP's flat parameters are buffers, and under mixed precision its shards are not the optimizer's
            # parameters: either would be first seen inside the first forward, which then differs from the next)
            # (held to the end: a name is kept by id, which a freed tensor would hand on)
            state = [*run.model.parameters(), *run.model.buffers(), *run.grad_sync.optimizer_params(),
                     *run.optimizer.param_groups[0]["params"],
                     *(v for state in run.optimizer.state.values() for v in state.values()),
                     *(b.flat for b in getattr(run.grad_sync, "all_buckets", ()) if b.flat is not None),
                     *(run.context.inputs().values() if run.context else ())]  # CP positions and mask
            for t in state:
                tracer.tensor_node(t)
            plans.train_step(run, batches, tracer.phase,
                             on_step=lambda kind, m, c: steps.append(((kind, m, c), len(tracer.graph))))
            if syncs is not None:  # the markers hold grad_sync and the tracer: left in place, a cycle
                del run.grad_sync.finish
                if hasattr(run.grad_sync, "mark"):
                    run.grad_sync.mark = contextlib.nullcontext
    ends = [start for _, start in steps[1:]] + [len(tracer.graph)]
    return tracer.graph, {key: (start, end) for (key, start), end in zip(steps, ends)}


def _mark_syncs(grad_sync, graph: TraceGraph, syncs: list) -> None:
    """The gradient sync's bucket launches (its `mark`: FSDP has none) and its end of backward append the
    span of nodes they add to `syncs`."""
    @contextlib.contextmanager
    def mark():
        start = len(graph)
        yield
        syncs.append((start, len(graph)))

    def end_of_backward(finish=grad_sync.finish):
        with mark():
            finish()

    grad_sync.finish = end_of_backward
    if hasattr(grad_sync, "mark"):
        grad_sync.mark = mark


def _name_optimizer_state(tracer: Tracer, run: plans.StageRun) -> None:
    """Names for what the optimizer updates besides the model's parameters (ZeRO/FSDP shards, FP32 masters,
    AdamW's moments and step): state that outlives the step, which the fused profile's optimizer pass writes
    back (trace/kernels.py) and the schedule tracks as it does parameters; and, for an end of backward traced
    alone, the buckets' reduced gradients overlap launched before it (layer_probe.py joins them to a step's)."""
    for i, p in enumerate(run.grad_sync.optimizer_params()):
        tracer.names.setdefault(id(p), (f"optimizer.shard.{i}", False))
    for i, p in enumerate(run.optimizer.param_groups[0]["params"]):
        tracer.names.setdefault(id(p), (f"optimizer.{i}.master", False))
        for key, v in run.optimizer.state[p].items():
            tracer.names[id(v)] = (f"optimizer.{i}.{key}", False)
    for k, bucket in enumerate(getattr(run.grad_sync, "all_buckets", ())):  # launched before a traced finish
        if bucket.flat is not None:
            tracer.names[id(bucket.flat)] = (f"grad_sync.flat.{k}", False)


def _template(kind: str, m: int, microbatches: int, probed: int) -> int:
    """The probed step a step is copied from: the same micro-batch when probed; else the first backward
    (fresh gradients), the last one (gradient sync), or a middle one (accumulation after accumulation)."""
    if m < probed - 1 or microbatches == probed:
        return m
    return probed - 1 if kind == "F" or m == microbatches - 1 else probed - 2


def schedule_stage(probe: TraceGraph, blocks: dict, plan: plans.TrainPlan, keep: bool = False,
                   stage: int | None = None, steps: dict | None = None, share: bool = False) -> TraceGraph:
    """The stage's step in its own schedule with `plan.microbatches` micro-batches, from a probe's steps:
    each step is a copy of a probed step whose inputs from other steps are re-pointed at the steps that
    play the same part (the same micro-batch's forward, the previous backward). `stage`: another stage's
    schedule, for a shifted copy of the probe's stage; then each node's inputs are in the order a copy
    shift_stage made has them, by their producers' ids (StageGraphs.kind_view). `steps`: the probe's steps
    as prepared for copying, kept across calls on one probe and stage (a dict, filled here); `share`: nodes
    and edges that are the probe's as they are keep its attribute dicts, not copies (for a graph that is read
    and dropped: no second copy of them alive).

    When the stage runs just the probed steps in the probed order (e.g. one micro-batch) the copy would be
    the probe itself: then `probe` is finished in place and returned (`keep`: a copy of it)."""
    by_source = stage is not None and stage != probe.graph["stage"]
    stage, M = probe.graph["stage"] if stage is None else stage, plan.microbatches

    def source(kind, m, c):
        """The probed step a step is copied from (the optimizer's one step for itself)."""
        return ("optimizer", None, None) if kind == "optimizer" else (kind, _template(kind, m, M, probed), c)

    probed = 1 + max(m for kind, m, _ in blocks if kind != "optimizer")
    order = [*stage_steps(plan, stage), *([("optimizer", M, None)] if ("optimizer", None, None) in blocks else [])]
    found = sorted((start, end, key) for key, (start, end) in blocks.items())
    if [key for _, _, key in found] == [source(*step) if step[0] == "optimizer" else step for step in order]:
        finished = copy_graph(probe, by_source) if keep or by_source else probe
        _renumber_orders(finished)
        return _finish(finished, plan, order, [start for start, _, _ in found])
    prefix = found[0][0]
    out = TraceGraph(**probe.graph)
    out.append((probe.node_attrs[n] for n in range(prefix)),
               ((u, v, e) for u in range(prefix) for v, e in probe.succs[u].items() if v < prefix), copy=not share)
    placed = {}  # (kind, microbatch) -> first node in `out`
    steps = {} if steps is None else steps  # probed step -> _Step
    # each parameter's or buffer's latest (node, version) in `out`: state a step reads from another step is
    # whatever was last written to it in this schedule (FSDP writes parameters every micro-batch)
    latest = {d["name"]: (n, d["version"]) for n, d in out.node_attrs.items() if _state(n, d)}


    def image(u, shift):
        """Probe node u (before or in another step) as read by a copy made `shift` micro-batches later:
        the same node of the step in `out` that plays u's step's part."""
        if u < prefix:
            return u
        if _state(u, probe.node_attrs[u]):
            return latest[probe.node_attrs[u]["name"]][0]
        start, end, (kind, k, c) = found[bisect.bisect_right(found, (u, float("inf"))) - 1]
        a, b = blocks[source(kind, k + shift, c)]
        assert b - a == end - start, f"probed steps {source(kind, k + shift, c)} and {(kind, k, c)} differ"
        return placed[(kind, k + shift, c)] + u - start

    for kind, m, c in order:
        key = source(kind, m, c)
        if key not in steps:  # each probed step prepared once, however many copies it makes
            steps[key] = _Step(probe, *blocks[key], by_source)
        step = steps[key]
        base = placed[(kind, m, c)] = len(out)
        shift = m - (probed if kind == "optimizer" else key[1])
        out.append(step.copy(base, shift * plan.virtual_stages, lambda u: image(u, shift), out, latest),
                   ((base + u if inside else image(u, shift), base + v, e) for u, inside, v, e in step.edges),
                   copy=not share)
        latest.update(step.written)
    _renumber_orders(out)
    roots = [[placed[step] + off for off in steps[source(*step)].roots] for step in order]
    return _finish(out, plan, order, [placed[step] for step in order], roots)


def stage_steps(plan: plans.TrainPlan, stage: int) -> list[tuple[str, int, int]]:
    """The steps a stage runs, in its schedule's order (pipeline.schedule; forwards only in inference)."""
    if plan.mode != "train":
        return [("F", m, 0) for m in range(plan.microbatches)]
    return schedule(plan.schedule, stage, plan.pp, plan.microbatches, plan.virtual_stages)


class _Step:
    """A probed step prepared for copying: its nodes' attributes, which of them move with the micro-batch,
    and its in-edges in their order (from inside the step as offsets, else as probe nodes); `by_source`: each
    node's inputs by their producers' ids (schedule_stage's)."""

    def __init__(self, probe: TraceGraph, a: int, b: int, by_source: bool = False):
        self.a, self.nodes, self.moving, self.edges = a, [], {}, []
        nodes = probe.node_attrs
        pred = {n: dict(sorted(probe.preds[n].items())) for n in range(a, b)} if by_source else probe.preds
        for n in range(a, b):
            data = nodes[n]
            self.nodes.append(data)
            if data["kind"] == "collective" and data["collective"] in ("send", "recv"):
                self.moving[n - a] = ("tag", None)
            elif data["kind"] == "tensor" and (data["name"] == f"t{n}" or data["version"]):
                earlier = [t for w in pred[n] for t in (sorted(probe.preds[w]) if by_source else probe.preds[w])
                           if nodes[t]["version"] == data["version"] - 1
                           and nodes[t]["shape"] == data["shape"]] if data["version"] else []
                self.moving[n - a] = ("tensor", earlier[0] if earlier else None)
            self.edges += [(u - a, True, n - a, e) if a <= u < b else (u, False, n - a, e) for u, e in pred[n].items()]
        self.state = [n - a for n in range(a, b) if _state(n, nodes[n])]  # parameters and buffers
        # a copy's inputs from outside it are made before it, as the probed step's are: the same roots
        self.roots = [n - a for n in _roots(probe, a, b)]

    def copy(self, base: int, tag_shift: int, image, out: TraceGraph, latest: dict) -> list[dict]:
        """The nodes' attributes for a copy at `base`, `tag_shift` tag pairs later (micro-batches times chunks):
        a send's or recv's tag (the micro-batch's), default tensor names, and the version of a tensor written in
        place (one past its earlier version there, e.g. a gradient accumulated over one more micro-batch; for a
        parameter or buffer, one past its `latest`; what the copy writes is left in `written`)."""
        nodes = list(self.nodes)
        for off, (what, earlier) in self.moving.items():
            data = nodes[off]
            if what == "tag":
                nodes[off] = {**data, "tag": data["tag"] + 2 * tag_shift}  # pipeline.tag: 2(mV + c) (+1 for gradients)
                continue
            data = {**data, "name": f"t{base + off}"} if data["name"] == f"t{self.a + off}" else dict(data)
            if earlier is not None:
                inside = earlier - self.a
                before = nodes[inside] if 0 <= inside < len(nodes) else out.nodes[image(earlier)]
                data["version"] = before["version"] + 1
            nodes[off] = data
        written = {}  # what this copy writes, into `latest` once its in-edges are placed (they read the earlier)
        for off in self.state:
            data = nodes[off]
            before = written.get(data["name"], latest.get(data["name"]))
            if data["version"] and before is not None:
                nodes[off] = data = {**data, "version": before[1] + 1}
            written[data["name"]] = (base + off, data["version"])
        self.written = written
        return nodes


def copy_graph(graph: TraceGraph, by_source: bool = False) -> TraceGraph:
    """A copy whose node, edge and graph attributes can change without changing `graph`'s. Edges go in by
    target, each one's inputs in their order, as the tracer added them (which level views keep); `by_source`:
    by source, as shift_stage copies them."""
    out = TraceGraph(**graph.graph)
    edges = ((u, v, e) for u, targets in graph.succs.items() for v, e in targets.items()) if by_source else \
        ((u, v, e) for v, sources in graph.preds.items() for u, e in sources.items())
    out.append((dict(d) for d in graph.node_attrs.values()), ((u, v, dict(e)) for u, v, e in edges))
    return out


def _state(n: int, d: dict) -> bool:
    """A parameter or buffer: a tensor the tracer named (others keep their default name t<node>)."""
    return d["kind"] == "tensor" and d["name"] != f"t{n}"


def _renumber_orders(graph: TraceGraph) -> None:
    """Each collective's `order` among its group's in the graph, in a new attribute dict (a shared one is the
    probe's: schedule_stage's `share`)."""
    counts, nodes = {}, graph.node_attrs
    for n, d in list(graph.collectives()):
        key = tuple(d["group"])
        nodes[n] = {**d, "order": counts.get(key, 0)}
        counts[key] = nodes[n]["order"] + 1


def _finish(graph: TraceGraph, plan, order, starts, roots=None) -> TraceGraph:
    graph.graph.update(schedule=plan.schedule, microbatches=plan.microbatches,
                       pipeline_schedule=[f"{kind}{m}" + (f".{c}" if plan.virtual_stages > 1 else "")
                                          for kind, m, c in order if kind != "optimizer"])
    add_schedule_deps(graph, starts, roots)
    return graph


def traced_stage_for(config: ModelConfig, plan: plans.TrainPlan) -> list[int]:
    """For each stage, the stage whose probe it is derived from (itself when it must be traced): middle
    stages whose chunks hold layers of the same kinds, as far apart (probes run GPipe's order, the same on
    every stage; shift_stage moves every chunk's layers by one offset)."""
    source, first_middle = [], {}
    for s in range(plan.pp):
        stage = plan.stage(config, s)
        chunks = stage.chunks or (stage.layers,)
        key = (tuple(tuple(layer_kind(config, i, plan.moe_load) for i in chunk) for chunk in chunks),
               tuple(chunk[0] - stage.layers[0] for chunk in chunks))
        source.append(first_middle.setdefault(key, s) if 0 < s < plan.pp - 1 else s)
    return source


def layer_kind(config: ModelConfig, layer: int, load=None) -> tuple:
    """What makes one layer's ops differ from another's: its MLP (DeepSeek's dense first layers), its window
    and, given a stated routing load (TrainPlan.moe_load: a row per MoE layer), an MoE layer's row."""
    moe = bool(config.n_experts) and layer >= config.first_k_dense
    return moe, config.layer_window(layer), tuple(load[layer - config.first_k_dense]) if moe and load else None


def shift_stage(graph: TraceGraph, mesh: Mesh, to_stage: int, layer_offset: int) -> TraceGraph:
    """A middle stage's trace moved to `to_stage`: `layers.i` -> `layers.{i + layer_offset}` in module and
    tensor names, global ranks (groups, peers) moved by the stage difference along pp (around the chain: a
    group holding every stage, the gradient norm's, is itself moved)."""
    moved, attrs = _stage_move(graph, mesh, to_stage, layer_offset)
    out = TraceGraph(**attrs)
    # edges in graph.copy()'s order: by source node, then by target
    out.append(map(moved, graph.node_attrs.values()),
            ((u, v, e) for u, targets in graph.succs.items() for v, e in targets.items()))
    return out


def shift_view(view: TraceGraph, mesh: Mesh, to_stage: int, layer_offset: int) -> TraceGraph:
    """What a graph made from a shifted stage (its schedule, its level view) would be, made from another shifted
    copy of the same probe with the same schedule: the view's nodes moved as shift_stage moves them (a level's
    group, named by its module, renamed too), its edges shared, not copied (read-only). Scheduling, level views
    and Chakra nodes see names, modules and groups only as keys, and the move is one-to-one, so they make the
    same nodes and edges of both; shift_stage's edge order, unlike the tracer's, is the same for every copy."""
    moved, attrs = _stage_move(view, mesh, to_stage, layer_offset)
    return with_node_attrs(view, {n: moved(d) for n, d in view.node_attrs.items()}, **attrs)


def _stage_move(graph: TraceGraph, mesh: Mesh, to_stage: int, layer_offset: int) -> tuple:
    """shift_stage's move of one node's attributes, and the moved graph's attributes."""
    shift = (to_stage - graph.graph["stage"]) * mesh.stride("pp")
    span = mesh.pp * mesh.stride("pp")
    renamed, groups = {}, {}

    def move(rank: int) -> int:  # pp is one digit of the rank: moved around the chain, the others kept
        return rank - rank % span + (rank + shift) % span

    def move_group(group: list) -> list:  # a group is moved once, however many nodes it is on
        key = tuple(group)
        if key not in groups:
            groups[key] = sorted(map(move, group))
        return groups[key]

    def rename(name: str) -> str:
        if not name.startswith("layers."):  # LAYER_PATH's start: most tensors' names (t<node>) are kept
            return name
        if name not in renamed:
            renamed[name] = LAYER_PATH.sub(lambda m: layer_path(int(m.group(1)) + layer_offset), name)
        return renamed[name]

    def moved(d: dict) -> dict:
        if d["kind"] == "tensor":
            return {**d, "name": rename(d["name"])}
        if d["kind"] == "op":
            out = {**d, "module": rename(d["module"])}
            if "num_ops" in d:  # a level's group, named by its module
                out["name"] = rename(d["name"])
            return out
        return {**d, "module": rename(d["module"]), "group": move_group(d["group"]),
                "src": None if d["src"] is None else move(d["src"]),
                "dst": None if d["dst"] is None else move(d["dst"])}

    return moved, {**graph.graph, "stage": to_stage, "rank": move(graph.graph["rank"])}


def add_schedule_deps(graph: TraceGraph, starts: list[int], roots: list | None = None) -> None:
    """Step k (nodes from starts[k] to starts[k+1]) runs after step k-1: its first nodes (those with no
    producer inside the step: _roots) read a 0-byte tensor written by step k-1's last node. `roots`: each
    step's first nodes, when known (a copied step's are those of the step it copies, moved)."""
    bounds, nodes = [*starts, len(graph)], graph.node_attrs
    for k in range(1, len(starts)):
        start, end = bounds[k], bounds[k + 1]
        last = next((n for n in range(start - 1, bounds[k - 1] - 1, -1) if nodes[n]["kind"] != "tensor"), None)
        firsts = roots[k] if roots else _roots(graph, start, end)
        if last is None or not firsts:
            continue
        token = graph.add_tensor([], "none", 0, name=f"schedule[{k}]", device="meta")
        graph.add_edge(last, token, arg=len(graph.succ[last]))
        for n in firsts:
            graph.add_edge(token, n, arg=len(graph.pred[n]))


def _roots(graph: TraceGraph, start: int, end: int) -> list[int]:
    """The ops and collectives from `start` to `end` whose inputs were all made before `start`."""
    nodes, pred = graph.node_attrs, graph.preds
    return [n for n in range(start, end) if nodes[n]["kind"] != "tensor" and _made_before(pred, n, start)]


def _made_before(pred: dict, n: int, start: int) -> bool:
    """Were all of node n's inputs made before node `start`? (Loops, not any() over a generator: asked of
    every node of a stage's step.)"""
    for t in pred[n]:
        for p in pred[t]:
            if p >= start:
                return False
    return True
