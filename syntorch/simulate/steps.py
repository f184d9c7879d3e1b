"""A training step predicted at the level of pipeline steps, without a node per micro-batch.

trace/training.py probes each traced stage with a few micro-batches and knows where each step's nodes lie
(a forward or backward of one micro-batch, and the optimizer). Each probed step is simulated once on its
own (its ops, its TP collectives and, in the step's last backward, the DP gradient buckets overlapping it,
as DDP launches them; graphs.py's `isolated` form), which gives its length, how much of it the compute
stream was busy and how much communication it exposed. The step-level programs then run those lengths in
each stage's schedule (pipeline.schedule: (step, micro-batch, chunk)), with the activations and their
gradients sent between (virtual) stages, and, for a head tied to the embedding, the all-reduce between the
first and the last stage before the optimizer. A step is copied from the probed step that plays its part
(trace/step_schedule.py's probed_microbatch: the same micro-batch when probed, else the first, a middle or the
last backward; a probe of two micro-batches has no middle one: it is the last one without its gradient sync,
layer_probe.middle_steps).

Cost: (steps per stage) x stages tasks; a stage's DP, CP and TP ranks share its program.
"""
import functools
from dataclasses import dataclass

from syntorch.simulate.engine import COMPUTE, P2P, Program, Sync, simulate
from syntorch.simulate.graphs import MeshFrame, graph_program
from syntorch.simulate.stats import kind_stats
from syntorch.trace.layer_probe import MIDDLE, StageProbe, expanded_steps, grad_group, middle_step
from syntorch.trace.step_schedule import probed_microbatch


@dataclass(frozen=True)
class StepCost:
    us: float  # the step simulated on its own, start to end (its p2p and cross-stage parts take no time)
    compute_us: float  # of which its compute stream was busy
    exposed_us: float = 0.0  # communication with the compute stream idle
    send_us: float = 0.0  # its p2p send (activations or their gradients), 0 if none
    send_at_us: float | None = None  # when in the step the send is issued (None: at its end), e.g. a last
    # backward sends its input's gradient before it synchronises the weights' gradients
    cross_us: float = 0.0  # its collective across stages (the tied embedding's all-reduce, the gradient
    # norm's before the optimizer), 0 if none
    cross_at_us: float | None = None  # when in the step it is issued (the step's later work waits for it)
    cross_name: str = "embedding"
    cross_members: int = 2  # the stages it meets
    model_flops: int = 0  # the model's: 3 x its forward's (backward does twice the forward's work), however
    # much is recomputed (MFU, as Megatron-LM and PaLM count it), causal attention over the pairs it keeps
    hw_flops: int = 0  # what the hardware runs: forward and backward ops as traced, recomputation included (HFU)
    model_flops_dense: int = 0  # model_flops with attention over every score (the op's dense_flops)
    streams_us: tuple = ()  # (stream, µs busy) of its communication streams (TP, DP, ...), simulated inside it

    @property
    def inner(self) -> tuple:
        """What the step's task stands for, for the statistics (engine.Program.inner)."""
        return self.compute_us, self.exposed_us, self.streams_us


def step_cost(graph, start: int, end: int, frame, sync_tp_backward: bool = False) -> StepCost:
    """Simulate graph nodes [start, end) (one probed step) on their own (`sync_tp_backward`: graph_program's)."""
    program, nodes = graph_program(graph, "step", frame, nodes=range(start, end), isolated=True,
                                   sync_tp_backward=sync_tp_backward)
    run = simulate([program])
    stats = kind_stats(run)[0]
    attrs = graph.node_attrs
    send = cross = 0.0
    send_at = cross_at = None
    model = hardware = dense = 0
    cross_name, members = "embedding", 2
    for task, n in enumerate(nodes):
        d = attrs[n]
        if d["kind"] != "collective":
            continue
        if d["collective"] == "send":
            send += d.get("duration_us") or 0.0
            send_at = run.starts[0][task]
        elif d["collective"] != "recv" and (stages := frame.kinds_in(d["group"])) > 1:
            cross += d.get("duration_us") or 0.0
            cross_at = run.starts[0][task]
            cross_name = "grad norm" if d["phase"] == "optimizer" else "embedding"
            members = stages
    for n in range(start, end):  # every op's FLOPs, those inside another's kernel too (no task of their own)
        d = attrs[n]
        if d["kind"] == "op" and d["phase"] in ("forward", "backward"):
            hardware += d["flops"]
            if d["phase"] == "forward":
                model += 3 * d["flops"]
                dense += 3 * d.get("dense_flops", d["flops"])
    streams = tuple((name, us) for name, us in stats["streams_busy_us"].items() if name != COMPUTE and us)
    return StepCost(run.end_us, stats["busy_us"], stats["exposed_comm_us"], send, send_at, cross, cross_at,
                    cross_name, members, model, hardware, dense, streams)


@functools.lru_cache(maxsize=2)
def mesh_frame(mesh) -> MeshFrame:
    """One MeshFrame for every step of a layout's stages (its per-group caches are the mesh's alone: made per
    stage, the gradient norm's group of every rank, 16,384 of them, was labelled and moved again each time)."""
    return MeshFrame(mesh)


def probe_costs(probe, blocks: dict, mesh, sync_tp_backward: bool = False) -> dict:
    """{block key: StepCost} of every step of a probe (trace/training.py's probe_stage)."""
    frame = mesh_frame(mesh)
    return {key: step_cost(probe, start, end, frame, sync_tp_backward) for key, (start, end) in blocks.items()}


def stage_costs(probe, mesh, sync_tp_backward: bool = False) -> dict:
    """probe_costs of a stage's probe (trace/layer_probe.py's StageProbe, or probe_stage's (graph, blocks)):
    when the probe left layers out, each step as the whole stage runs it (layer_probe.expanded_steps) and the
    optimizer step from its own probe; and the middle backwards a probe of two micro-batches derives
    (StageProbe.middles, keyed ("B", MIDDLE, chunk))."""
    frame = mesh_frame(mesh)
    if not isinstance(probe, StageProbe) or not probe.runs:
        costs = probe_costs(*probe, mesh, sync_tp_backward)
    else:
        costs = probe_costs(*probe.optimizer, mesh, sync_tp_backward)
        for key, step in expanded_steps(probe, grad_group(probe[0], mesh)):
            costs[key] = step_cost(step, 0, len(step), frame, sync_tp_backward)
    for chunk, middle in getattr(probe, "middles", {}).items():  # None: the last backward's nodes as they are
        costs["B", MIDDLE, chunk] = costs["B", 1, chunk] if middle is None else \
            step_cost(*middle_step(probe, chunk), frame, sync_tp_backward)
    return costs


def step_costs(costs: dict, schedule: list[tuple], microbatches: int) -> list[StepCost]:
    """The cost of each scheduled step: that of the probed step it is a copy of (probe keys (kind, m) or,
    interleaved, (kind, m, chunk)); a middle backward, when two micro-batches were probed, the one derived
    from the last (stage_costs)."""
    probed = 1 + max(key[1] for key in costs if key[0] == "F")
    out = []
    for kind, m, chunk in schedule:
        if kind == "B" and probed == 2 and 0 < m < microbatches - 1:
            m = MIDDLE
        else:
            m = probed_microbatch(kind, m, microbatches, probed)
        out.append(costs[(kind, m, chunk)] if (kind, m, chunk) in costs else costs[(kind, m)])
    return out


def pipeline_programs(schedules: list[list[tuple]], costs: list[list[StepCost]], pp: int, virtual: int = 1,
                      optimizer: list | None = None, ranks: int = 1) -> list[Program]:
    """One program per stage. `schedules[s]`: stage s's (step, micro-batch, chunk) order; `costs[s]`: the
    StepCost of each; `optimizer[s]`: the optimizer's StepCost (None without one). Chunk c of stage s is
    virtual stage c * pp + s; activations go from virtual stage j to j + 1, gradients back."""
    last = virtual * pp - 1
    programs = []
    for s, order in enumerate(schedules):
        p = Program(f"stage {s}", ranks)
        prev = None
        for (kind, m, chunk), c in zip(order, costs[s]):
            j = chunk * pp + s
            source = j - 1 if kind == "F" else j + 1
            deps = []
            if 0 <= source <= last:
                deps.append(p.add(f"recv {kind}{m}", P2P, c.send_us, (), Sync("recv", (kind, m, j))))
            target = j + 1 if kind == "F" else j - 1
            prev = _add_step(p, f"{kind}{m}" + (f".{chunk}" if virtual > 1 else ""), c, deps,
                             Sync("send", (kind, m, target)) if 0 <= target <= last else None)
        if optimizer and optimizer[s] is not None:
            _add_step(p, "optimizer", optimizer[s], [prev] if prev is not None else [], None)
        programs.append(p)
    return programs


def _add_step(p: Program, name: str, c: StepCost, deps: list, send: Sync | None) -> int:
    """The step's compute as pieces cut where it issues its send (which does not hold the compute stream)
    and its collective across stages (which the rest of the step waits for); returns its last task."""
    send_at = c.us if c.send_at_us is None else c.send_at_us
    # the collective across stages (the tied embedding's gradient) waits for the step's send: Megatron
    # all-reduces it in finalize_model_grads, after the schedule's last send; issued before the send (its
    # gradient is ready early in the last stage's backward) it would wait for a stage that waits for the send
    cross_at = max(c.us if c.cross_at_us is None else c.cross_at_us, send_at if send else 0.0)
    marks = sorted([*([(send_at, 0, "send")] if send else []), *([(cross_at, 1, "cross")] if c.cross_us else [])])
    done, inner = 0.0, c.inner  # the step's own accounting, on its first piece
    prev = None
    for at, _, what in [*marks, (c.us, 2, "end")]:
        if prev is None or at > done:
            prev = p.add(name if prev is None else f"{name} (cont.)", COMPUTE, at - done, deps if prev is None else [prev],
                         inner=inner)
            inner, done = (0.0, 0.0, ()), at
        if what == "send":
            p.add(f"send {name}", P2P, c.send_us, [prev], send)
        elif what == "cross":
            prev = p.add(f"{c.cross_name} all_reduce", f"comm {c.cross_name}", c.cross_us, [prev],
                         Sync("coll", (c.cross_name,), c.cross_members))
    return prev
