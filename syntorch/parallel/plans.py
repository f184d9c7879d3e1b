"""One training plan over the (dp, pp, cp, tp) mesh: which parallelisms, in which order, and one step of it.

    plan = TrainPlan(dp=4, tp=8, pp=8, sp=True, zero=1, microbatches=8, seq=2048)  # ep=4: experts over DP
    plan.check(config)
    run = apply_plans(config, plan, groups, device="meta")
    train_step(run, batches)

`apply_plans` takes this rank's model from assemble.assemble_rank, which composes EP, TP, the stage cut, FP8,
recomputation and CP in one fixed order for every caller (assemble.py says why), and adds what training holds:
1. DP/ZeRO buckets the parameters the stage kept, or FSDP (zero 3, fsdp.py) shards them; it goes last because
   its buckets or shards must be the final ones. Gradients are averaged over DP x CP (the grad group);
   experts are synchronised (ZeRO/FSDP: sharded) over their expert-DP group instead (the replicas of the
   same expert shards), averaged over DP x CP too.
2. The optimizer (AdamW) gets what this rank updates: its parameters, or its ZeRO/FSDP shards. Its step
   clips the gradients by their global norm first (clip.py), as Megatron does.
"""
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from syntorch.config import MAX_ELEMENTS, ModelConfig
from syntorch.errors import UserError
from syntorch.parallel import pipeline as pp_
from syntorch.parallel.assemble import RankPlan, assemble_rank
from syntorch.parallel.clip import clip_factor, copies_of, shard_weights
from syntorch.parallel.context import ContextSplit, check_cp
from syntorch.parallel.buckets import GradSync, GradSyncs
from syntorch.parallel.expert import check_ep, check_etp, is_expert_param
from syntorch.parallel.fsdp import FullyShard, check_grad_options
from syntorch.parallel.layout import check_layout
from syntorch.parallel.mesh import MeshGroups
from syntorch.parallel.moe_load import check_load
from syntorch.parallel.recompute import check_recompute
from syntorch.parallel.precision import MixedPrecision
from syntorch.parallel.tensor import check_sp, check_tp


@dataclass(frozen=True)
class TrainPlan(RankPlan):
    """A RankPlan (the parallelisms that shape each rank's model, assemble.py) and one training step's options."""
    zero: int = 0  # 0: DDP all-reduce, 1/2: ZeRO stage 1/2, 3: fully sharded (FSDP)
    bucket_mb: float = 25.0
    schedule: str = "1f1b"
    microbatches: int = 1
    micro_batch_size: int = 1
    seq: int = 1024
    lr: float = 1e-4
    scatter_gather: bool = True  # with TP, stages exchange 1/t of the stream each and all-gather it (pipeline.py)
    # Megatron-Core's --overlap-grad-reduce / --overlap-param-gather (data.py). Megatron-Core defaults both to
    # False; NeMo's performance recipes turn them on. Here: the gradient reduce overlaps backward (NeMo's
    # choice, and what the calibration was fitted with); ZeRO's parameter all-gather follows the optimizer
    # step (Megatron-Core's default)
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    # Megatron-LM's --async-tensor-model-parallel-allreduce (2022 on, Korthikanti et al. 2022): a TP collective of
    # the backward pass starts after the input gradient and overlaps the weight gradient. False: Megatron-LM 2021's
    # synchronous one after the linear's whole backward (simulate/graphs.py). A plan option only (bench/
    # validate_published.py's 2021 rows): the Chakra files do not carry the synchronisation yet
    async_tp_allreduce: bool = True
    clip_grad: float = 1.0  # gradient clipping by the global norm (clip.py), Megatron's default; 0: none
    reshard_after_forward: bool = True  # FSDP2's option (fsdp.py): false keeps layers whole until backward
    # "fp32": gradients reduced over DP in FP32 (data.py, fsdp.py), as Llama 3 and Megatron-Core's bf16 default.
    # Default "model": FSDP2's default (reduce_dtype None: the parameters' dtype), torch DDP's, and what the
    # calibration tables were fitted with; predictions of earlier plans stay as they were
    grad_reduce_dtype: str = "model"

    @property
    def grad_ranks(self) -> int:
        """How many ranks gradients are averaged (and ZeRO/FSDP shard) over: DP x CP."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """How many ranks hold each expert shard (and ZeRO/FSDP shard it over): TP x CP x DP / (etp x ep)."""
        return self.mesh.expert_dp

    def __post_init__(self):
        """Every option's own check, once, when the plan is made: one line with the values in it."""
        super().__post_init__()
        check_sp(self.sp, self.tp, self.seq)
        if self.seq < 1:
            raise UserError(f"--seq must be at least 1, got {self.seq}")
        check_cp(self.cp, self.seq, self.tp, self.sp)
        if self.zero not in (0, 1, 2, 3):
            raise UserError(f"--zero must be 0 (DDP), 1, 2 or 3 (FSDP), got {self.zero}")
        if self.zero and self.grad_ranks == 1:
            raise UserError(f"--zero {self.zero} shards over the data-parallel group; it needs --dp > 1 (or --cp > 1)")
        if self.cp > 1 and self.mode == "infer":
            raise UserError("--cp splits training sequences; --mode infer does not take it, drop --cp")
        if self.zero and self.mode == "infer":
            raise UserError("--zero shards optimizer state and gradients, which --mode infer has none of; drop --zero")
        if self.bucket_mb <= 0:
            raise UserError(f"--bucket_mb must be positive, got {self.bucket_mb}")
        if not self.clip_grad >= 0:
            raise UserError(f"--clip_grad must be 0 (no clipping) or positive, got {self.clip_grad}")
        for name in ("microbatches", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.mode not in ("train", "infer"):
            raise UserError(f"--mode must be train or infer, got {self.mode!r}")
        pp_.check_schedule(self.schedule)
        check_recompute(self.recompute, self.mode)
        if self.virtual_stages > 1 and self.mode == "infer":
            raise UserError("--virtual_stages interleaves a training schedule; drop it with --mode infer")
        if self.schedule == "1f1b":
            pp_.check_interleaving(self.pp, self.microbatches, self.virtual_stages)
        check_layout(self.layout, self.pp)
        check_grad_options(self.reshard_after_forward, self.grad_reduce_dtype, self.zero)

    def check(self, config: ModelConfig, world_size: int | None = None, global_batch: int | None = None) -> None:
        """What depends on the model and the run: the context, the layers and heads to split, the counts."""
        if world_size is not None:
            self.mesh.check_world_size(world_size)
        if self.seq > config.n_positions:
            raise UserError(f"--seq {self.seq} must be in 1..{config.n_positions} ({config.name}'s context)")
        activation = self.micro_batch_size * self.seq * max(config.d_model, config.d_ff, config.vocab_size)
        if activation >= MAX_ELEMENTS:
            raise UserError(f"--micro_batch_size {self.micro_batch_size} x --seq {self.seq} makes activations of "
                            f"{activation:.3g} elements, past what any device can index; lower them")
        if self.cp > 1 and not config.causal:
            raise UserError(f"--cp splits causal (decoder) attention; {config.name} attends both ways, drop --cp")
        if global_batch is not None and global_batch < 1:
            raise UserError(f"--global_batch must be at least 1, got {global_batch}")
        if global_batch is not None and global_batch != self.dp * self.microbatches * self.micro_batch_size:
            raise UserError(f"--global_batch {global_batch} is not dp({self.dp}) * microbatches({self.microbatches})"
                            f" * micro_batch_size({self.micro_batch_size}) = "
                            f"{self.dp * self.microbatches * self.micro_batch_size}; make them match")
        pp_.stage_chunks(config.n_layer, self.pp, self.virtual_stages, self.layout)
        check_tp(config, self.tp)
        check_ep(config, self.ep)
        check_etp(config, self.etp, self.tp, self.ep, self.micro_batch_size * self.seq // self.cp)
        check_load(config, self.moe_load)


@dataclass
class StageRun:
    """Everything one rank needs to run its part of a training step."""
    model: nn.Module
    plan: TrainPlan
    stage: pp_.Stage
    groups: MeshGroups
    grad_sync: GradSync
    optimizer: torch.optim.Optimizer
    tp_plan: object = None  # tensor.TPPlan: styles and local shapes, when TP applied
    precision: MixedPrecision | None = None  # fp16/bf16 training: FP32 masters the optimizer updates
    context: ContextSplit | None = None  # this rank's share of each sequence, under CP
    tp_replicated: frozenset = frozenset()  # ids of the parameters every TP rank holds whole (clip.py)
    norm_weights: dict = field(default_factory=dict)  # flat shards' per-element weights in the norm (clip.py)

    def chunk(self, index: int) -> nn.Module:
        """The model as the stage's chunk `index` runs it (the model itself without interleaving)."""
        if index not in self._chunks:
            self._chunks[index] = pp_.chunk_view(self.model, self.stage, index)
        return self._chunks[index]

    def __post_init__(self):
        self._chunks = {}

    @property
    def split(self):
        """The TP group the stream between stages is scattered over (Megatron's scatter/gather), or None."""
        return self.groups.tp if self.plan.scatter_gather and self.plan.tp > 1 and not self.plan.sp else None


def apply_plans(config: ModelConfig, plan: TrainPlan, groups: MeshGroups, device="meta",
                dtype=torch.float32, model: nn.Module | None = None) -> StageRun:
    """This rank's model (assemble.assemble_rank: EP, TP, the stage cut, FP8, recomputation, CP), then
    DP/ZeRO/FSDP and the optimizer on top (the module docstring says why). `model`: the whole model already
    built on `device` in `dtype` (`syntorch train` loads a checkpoint's weights), instead of a fresh one."""
    rank = assemble_rank(config, plan, groups, device, dtype, model)
    model, tp_plan, replicated = rank.model, rank.tp_plan, rank.tp_replicated
    context = ContextSplit(plan.seq, plan.cp, groups.cp_rank, device) if plan.cp > 1 else None
    grad_sync = _grad_sync(model, plan, groups, _partial_grads(model, tp_plan, groups))

    precision = MixedPrecision.of(grad_sync.optimizer_params(), dtype) if plan.mode == "train" else None
    # multi-tensor AdamW (torch's foreach path, as Megatron's fused Adam): a few ops over all parameters
    optimizer = torch.optim.AdamW(precision.masters if precision else grad_sync.optimizer_params(), lr=plan.lr,
                                  foreach=True)
    _init_optimizer_state(optimizer)
    weights = shard_weights(grad_sync, copies_of(model, plan, groups, replicated), plan.tp) if plan.clip_grad else {}
    return StageRun(model, plan, rank.stage, groups, grad_sync, optimizer, tp_plan, precision, context, replicated,
                    weights)


def _grad_sync(model: nn.Module, plan: TrainPlan, groups: MeshGroups, partial):
    """DDP/ZeRO buckets (GradSync) or FSDP units (FullyShard) over the grad group; with EP, the experts'
    gradients in a GradSync (or FSDP units) of their own over expert-DP, averaged over the grad group."""
    params = list(model.parameters())
    if plan.zero == 3:
        return FullyShard(model, groups.grad_group, plan.grad_ranks, partial, groups.embedding,
                          plan.reshard_after_forward, plan.grad_reduce_dtype == "fp32",
                          (groups.expert_dp, plan.expert_dp) if plan.ep > 1 else None)
    overlap = dict(overlap_grad_reduce=plan.overlap_grad_reduce, overlap_param_gather=plan.overlap_param_gather,
                   reduce_fp32=plan.grad_reduce_dtype == "fp32")
    if plan.ep == 1:
        sync = GradSync(params, groups.grad_group, plan.grad_ranks, plan.zero, plan.bucket_mb, partial, **overlap)
    else:
        experts = {id(p) for n, p in model.named_parameters() if is_expert_param(n)}
        dense_partial, expert_partial = _split_partial(partial, experts)
        dense = GradSync([p for p in params if id(p) not in experts], groups.grad_group, plan.grad_ranks, plan.zero,
                         plan.bucket_mb, dense_partial, **overlap)
        expert = GradSync([p for p in params if id(p) in experts], groups.expert_dp, plan.expert_dp, plan.zero,
                          plan.bucket_mb, expert_partial, divisor=plan.grad_ranks, **overlap)
        sync = GradSyncs([dense, expert])
    if plan.overlap_param_gather and plan.zero:
        sync.watch(model)
    return sync


def _split_partial(partial: list[tuple[list, object]], experts: set[int]) -> tuple[list, list]:
    """`partial` as (dense, expert) parts: each GradSync sums its own parameters' partial gradients (the
    experts' TP-partial biases) before their buckets are reduced."""
    parts = ([], [])
    for params, group in partial:
        for side, part in enumerate(parts):
            mine = [p for p in params if (id(p) in experts) == bool(side)]
            if mine:
                part.append((mine, group))
    return parts


def _partial_grads(model: nn.Module, tp_plan, groups: MeshGroups) -> list[tuple[list, object]]:
    """Gradients other ranks hold parts of: the embedding tied across the first and last stage, and the
    parameters TP's sequence parallel applies to each rank's positions only (`partial_grads`, if reported)."""
    params = dict(model.named_parameters())
    partial = []
    if groups.embedding is not None:
        partial.append(([params["lm_head.weight" if "lm_head.weight" in params else "tok_emb.weight"]],
                        groups.embedding))
    sp_names = [n for n in getattr(tp_plan, "partial_grads", []) if n in params]
    if sp_names:
        partial.append(([params[n] for n in sp_names], groups.tp))
    return partial


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    # AdamW creates its moments lazily on the first step; create them now so a traced step is a steady-state
    # one (the moments exist, as in every step but the first), and a real first step gives the same numbers.
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}


def train_step(run: StageRun, batches: list[tuple[torch.Tensor, torch.Tensor]], phase=None, on_step=None):
    """One optimizer step over `batches` (a (tokens, targets) pair per micro-batch, or (tokens, targets,
    inputs) with the model's other arguments, such as BERT's attention_mask) in the stage's schedule.

    `phase(name)` labels what runs inside (Tracer.phase when traced); `on_step(kind, microbatch, chunk)` is
    called before each schedule step and once with ("optimizer", None, None). Returns the summed loss on the last stage (else None).
    In "infer" mode only the forwards run, in micro-batch order, without gradients."""
    phase = phase or (lambda name: nullcontext())
    plan, stage, links = run.plan, run.stage, run.groups
    sends = []  # the sends' works, waited on once the schedule is done (see pipeline.send_forward)
    if plan.mode == "infer":
        with torch.no_grad():
            for m, (tokens, _) in enumerate(batches):
                if on_step:
                    on_step("F", m, 0)
                _forward(run, tokens, m, phase, sends)
        pp_.wait_sends(sends)
        return None
    order = pp_.schedule(plan.schedule, stage.index, plan.pp, len(batches), plan.virtual_stages)
    inputs, outputs, losses = {}, {}, []
    for kind, m, c in order:
        if on_step:
            on_step(kind, m, c)
        if kind == "F":
            tokens, targets, *extra = batches[m]
            inputs[m, c], outputs[m, c] = _forward(run, tokens, m, phase, sends, targets, c, *extra)
            if stage.holds_loss(c):
                outputs[m, c] = outputs[m, c] / len(batches)  # gradients accumulate to the mean over micro-batches
                losses.append(outputs[m, c].detach())
            continue
        with phase("backward"):
            run.grad_sync.active = m == len(batches) - 1  # DDP's no_sync for all but each chunk's last
            x, y = inputs.pop((m, c)), outputs.pop((m, c))
            grad = None if stage.holds_loss(c) else pp_.recv_backward(y, links, m, c, plan.virtual_stages, run.split)
            if run.precision and stage.holds_loss(c):
                y = run.precision.scale_loss(y)  # fp16: the loss scaled, so small gradients stay above fp16's least
            torch.autograd.backward(y, grad)
            if not stage.holds_input(c):
                sends.append(pp_.send_backward(x.grad, links, m, stage.in_boundary(c), plan.virtual_stages, run.split))
    with phase("backward"):
        pp_.wait_sends(sends)
        run.grad_sync.finish()
    if on_step:
        on_step("optimizer", None, None)
    with phase("optimizer"):
        _optimizer_step(run)
        run.grad_sync.gather_params()
    return sum(losses) if losses else None  # outside every phase: not part of the step


def _optimizer_step(run: StageRun) -> None:
    """Megatron's order: the gradient norm (clip.py), then the update of what the optimizer holds (FP32
    masters under mixed precision: precision.py casts the gradients first, then clips) with clipped gradients."""
    scaler = run.precision.scaler if run.precision else None
    factor = clip_factor(run, run.plan.clip_grad, 1.0 / scaler.scale if scaler else 1.0)
    if run.precision:
        run.precision.step(run.optimizer, factor)
        return
    if factor is not None:
        torch._foreach_mul_([p.grad for p in run.grad_sync.optimizer_params() if p.grad is not None], factor)
    run.optimizer.step()


def _forward(run: StageRun, tokens, m: int, phase, sends: list, targets=None, chunk: int = 0, extra=None):
    """Micro-batch m through one chunk of this stage: receive (or take the tokens), run, send on.
    `extra`: the model's other arguments for this micro-batch. Returns (input, output)."""
    plan, stage, links, context = run.plan, run.stage, run.groups, run.context
    with phase("forward"):
        seq_len = plan.seq // plan.cp  # this rank's tokens of each sequence
        if stage.holds_input(chunk):
            x = tokens if context is None else context.local(tokens)
        else:
            param = next(run.model.parameters())
            shape = pp_.activation_shape(run.model.config, plan.micro_batch_size, seq_len, plan.tp, plan.sp)
            x = pp_.recv_forward(shape, param.dtype, param.device, links, m, stage.in_boundary(chunk),
                                 plan.virtual_stages, run.split)
        if stage.holds_loss(chunk) and context is not None:
            targets = context.local(targets)
        y = pp_.stage_forward(run.chunk(chunk), x, targets if stage.holds_loss(chunk) else None,
                              None if stage.holds_input(chunk) else seq_len,
                              **(context.inputs() if context else {}), **(extra or {}))
        if not stage.holds_loss(chunk):
            sends.append(pp_.send_forward(y, links, m, chunk, plan.virtual_stages, run.split))
    return x, y


@torch.no_grad()
def eval_step(run: StageRun, batches: list) -> torch.Tensor | None:
    """The loss of `batches` (as train_step takes them) without gradients or an update: each micro-batch
    through every chunk in turn (sends do not block, so no schedule is needed). Returns the mean over the
    micro-batches on the last stage, else None."""
    sends, losses = [], []
    for m, (tokens, targets, *extra) in enumerate(batches):
        for c in range(run.plan.virtual_stages):
            _, y = _forward(run, tokens, m, lambda name: nullcontext(), sends, targets, c, *extra)
            if run.stage.holds_loss(c):
                losses.append(y)
    pp_.wait_sends(sends)
    return sum(losses) / len(losses) if losses else None
