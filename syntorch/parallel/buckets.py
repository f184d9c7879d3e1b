"""Data parallelism: DDP-style bucketed gradient all-reduce, and ZeRO-1/2 (reduce-scatter + all-gather).

Parameters are packed into buckets of at most `bucket_mb` MiB in reverse registration order (the order
backward produces their gradients, as DDP does). Gradients are synchronised only on the backward of a
step's last micro-batch (DDP's no_sync for the others). With `overlap_grad_reduce` (Megatron-Core's
--overlap-grad-reduce) a bucket is launched the moment its last gradient is accumulated, so communication
overlaps the rest of backward; without it every bucket is launched at the end of backward, after the last
gradient (each bucket's flattening reads a 0-element tensor made from it: the dependency a trace keeps):

- zero 0 (DDP): each bucket's gradients are flattened, divided by dp and all-reduced; `finish` copies the
  averaged values back into `.grad`. The optimizer updates every parameter.
- zero 2: the flattened bucket (padded to a multiple of dp) is reduce-scattered instead; this rank keeps
  1/dp of it. The optimizer updates only this rank's parts of all buckets, one flat parameter, and
  `gather_params` all-gathers each bucket's updated part back into the parameters.
- zero 1: the same, but the reduce-scatters wait for the end of backward (gradients are kept whole until
  then, as ZeRO stage 1 does), so they do not overlap it.

ZeRO's updated parameters are all-gathered after the optimizer step; with `overlap_param_gather`
(Megatron-Core's --overlap-param-gather) they are instead all-gathered at the next step's first forward:
every bucket's all-gather is issued when the forward starts (last bucket first: it holds the first layers)
and a bucket's parameters are copied out of it just before the first module that uses them runs, so the
gathers overlap the layers before. (Until that forward the model's weights are the step before's:
`gather_stale` makes them whole, e.g. before a checkpoint.)

With `reduce_fp32` (--grad_reduce_dtype fp32; Megatron-Core's accumulate_allreduce_grads_in_fp32, its default
with bf16, and Llama 3's FP32 gradient reduce-scatter) each bucket is flattened into FP32 before its
collective, which then moves 4-byte elements and sums in FP32; the reduced values stay in that FP32 buffer
until they are copied back into `.grad` (or the ZeRO shard's gradient) in the model dtype.

Gradients that several ranks each hold a part of are summed over those ranks at the end of backward, before
their own (last) buckets: a weight shared by the first and the last pipeline stage (a tied LM head, over
Megatron's embedding group) and, under sequence parallel, the LayerNorms and biases each TP rank applied to
its part of the sequence (over the TP group), as Megatron's finalize_model_grads does.
"""
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from syntorch.parallel import distributed as comm


@dataclass
class Bucket:
    params: list[nn.Parameter]
    size: int  # elements, padded to a multiple of dp under ZeRO
    ready: int = 0
    flat: torch.Tensor | None = None  # zero 0: the all-reduced gradients; zero 1/2: this rank's reduced part


def make_buckets(params: list[nn.Parameter], bucket_bytes: int, pad_to: int = 1) -> list[Bucket]:
    """Reverse registration order, a new bucket whenever the next parameter would overflow this one."""
    groups: list[list[nn.Parameter]] = [[]]
    filled = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if groups[-1] and filled + nbytes > bucket_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(p)
        filled += nbytes
    return [Bucket(g, -(-sum(p.numel() for p in g) // pad_to) * pad_to) for g in groups if g]


@dataclass
class GradSync:
    """Gradient synchronisation of one stage's parameters over its DP group (see the module docstring)."""
    params: list[nn.Parameter]
    dp_group: object
    dp: int
    zero: int = 0
    bucket_mb: float = 25.0
    # (parameters, group): gradients of which each rank of `group` holds a part (a tied embedding across
    # stages, LayerNorms under sequence parallel); summed over the group at the end of backward, then
    # DP-synchronised in buckets of their own
    partial: list[tuple[list[nn.Parameter], object]] = field(default_factory=list)
    buckets: list[Bucket] = field(default_factory=list)
    active: bool = False  # True during the backward of the step's last micro-batch
    # what the summed gradients are divided by, when not the group's size: expert gradients already sum the
    # tokens of every EP rank, so their expert-DP group averages them over all dp ranks
    divisor: int = 0
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    reduce_fp32: bool = False
    # a bucket launched in backward is launched inside `mark()`: a probe records where its nodes are, which
    # a middle backward (no sync) lacks (trace/training.py's _mark_syncs)
    mark: object = field(default=nullcontext, repr=False, compare=False)

    def __post_init__(self):
        self.divisor = self.divisor or self.dp
        pad, cap = (self.dp if self.zero else 1), int(self.bucket_mb * 2**20)
        late = {id(p) for params, group in self.partial if group is not None for p in params}
        self.buckets = make_buckets([p for p in self.params if id(p) not in late], cap, pad) if self.dp > 1 else []
        self.late = make_buckets([p for p in self.params if id(p) in late], cap, pad) if self.dp > 1 else []
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        # ZeRO: this rank's part of every bucket, in one flat parameter the optimizer updates (as DeepSpeed's
        # flat partition), so its step is a few ops on one tensor whatever the bucket count
        self.shard = nn.Parameter(torch.cat([self._shard_of(_flat([p.detach() for p in b.params], b.size))
                                             for b in self.all_buckets])) if self.zero and self.all_buckets else None
        # the hooks hold this object weakly: a parameter's hooks live in torch's C++ grad accumulator, where the
        # cyclic collector cannot see the cycle through self.params (each traced stage leaked its whole model)
        ready = weakref.WeakMethod(self._grad_ready)
        for p in self.params:
            if id(p) in self._bucket_of:
                p.register_post_accumulate_grad_hook(lambda p: ready()(p))
        self._last_grad = None  # the gradient accumulated last in this backward
        # overlap_param_gather: id -> bucket to gather, its gathered values. Stale from the start, as in every
        # step but the first (a traced step is a steady-state one; the first gathers what the weights hold)
        self._gathered = {}
        self._stale = {id(b): b for b in self.all_buckets} if self.overlap_param_gather and self.shard is not None else {}

    @property
    def all_buckets(self) -> list[Bucket]:
        return [*self.buckets, *self.late]

    def _shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        n = flat.numel() // self.dp
        rank = comm.rank_in(self.dp_group)
        return flat[rank * n:(rank + 1) * n].clone()

    def optimizer_params(self) -> list[nn.Parameter]:
        """What this rank's optimizer updates: every parameter, or under ZeRO its flat shard."""
        return [self.shard] if self.shard is not None else list(self.params)

    @torch.no_grad()
    def _grad_ready(self, p: nn.Parameter) -> None:
        if not self.active:
            return
        self._last_grad = p.grad
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params) and self.zero != 1 and self.overlap_grad_reduce:
            with self.mark():
                self._launch(bucket)

    def _launch(self, bucket: Bucket, after: torch.Tensor | None = None) -> None:
        grads = [p.grad for p in bucket.params]
        flat = _flat(grads if after is None else [after.new_empty(0, dtype=grads[0].dtype), *grads], bucket.size)
        if self.reduce_fp32:
            flat = flat.float()
        if self.zero:
            bucket.flat = comm.reduce_scatter(flat, 0, "sum", self.dp_group).div_(self.divisor)
        else:
            bucket.flat = comm.all_reduce(flat.div_(self.divisor), "sum", self.dp_group)
        bucket.ready = 0

    @torch.no_grad()
    def finish(self) -> None:
        """End of the last backward: pending buckets, partial gradients summed, their buckets, then (DDP) the
        averaged gradients back into `.grad`."""
        if self.zero == 1 or not self.overlap_grad_reduce:
            for bucket in self.buckets:
                self._launch(bucket, self._last_grad)
        for params, group in self.partial:
            if group is not None:
                grads = [p.grad for p in params]
                flat = comm.all_reduce(_flat(grads, sum(g.numel() for g in grads)), "sum", group)
                torch._foreach_copy_(grads, _split(flat, params))
        for bucket in self.late:
            self._launch(bucket)
        if self.shard is not None:
            self.shard.grad = torch.cat([b.flat for b in self.all_buckets]).to(self.shard.dtype)
        for bucket in self.all_buckets if not self.zero else ():
            torch._foreach_copy_([p.grad for p in bucket.params], _split(bucket.flat, bucket.params))
        for bucket in self.all_buckets:
            bucket.flat = None
        if self.dp == 1 and self.divisor > 1:  # no replica to reduce with (EP over all of DP): just the average
            torch._foreach_div_([p.grad for p in self.params if p.grad is not None], self.divisor)

    @torch.no_grad()
    def gather_params(self) -> None:
        """ZeRO, after the optimizer step: every rank's updated shard back into the whole parameters (with
        overlap_param_gather, at the next forward: `watch`)."""
        if self.shard is None:
            return
        if self.overlap_param_gather:
            self._stale = {id(b): b for b in self.all_buckets}
            return
        for bucket in self.all_buckets:
            self._copy_out(bucket, self._gather(bucket))

    def _gather(self, bucket: Bucket) -> torch.Tensor:
        before = next(i for i, b in enumerate(self.all_buckets) if b is bucket)
        start = sum(b.size for b in self.all_buckets[:before]) // self.dp
        return comm.all_gather(self.shard.detach()[start:start + bucket.size // self.dp], 0, self.dp_group)

    @staticmethod
    def _copy_out(bucket: Bucket, full: torch.Tensor) -> None:
        torch._foreach_copy_(bucket.params, _split(full, bucket.params))

    def watch(self, model: nn.Module) -> None:
        """overlap_param_gather: each module with parameters of a bucket gathers that bucket before it runs."""
        bucket_of = {id(p): b for b in self.all_buckets for p in b.params}
        for module in model.modules():
            mine = [bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of]
            if mine:
                module.register_forward_pre_hook(lambda _module, _args, mine=mine: self.gather_stale(mine))

    @torch.no_grad()
    def gather_stale(self, buckets: list[Bucket] | None = None) -> None:
        """overlap_param_gather: `buckets` (default all) whole again if the step left them stale (before a
        checkpoint, or from a module's forward pre-hook)."""
        buckets = self.all_buckets if buckets is None else buckets
        if not self._stale:
            return
        if not self._gathered:  # the step's first forward: every all-gather issued now, in forward's order
            self._gathered = {key: self._gather(b) for key, b in reversed(self._stale.items())}
        for bucket in buckets:
            if self._stale.pop(id(bucket), None) is not None:
                self._copy_out(bucket, self._gathered.pop(id(bucket)))


def _flat(tensors: list[torch.Tensor], size: int) -> torch.Tensor:
    """The tensors flattened into one buffer of `size` elements (zero padding at the end), in one copy."""
    pad = size - sum(t.numel() for t in tensors)
    parts = [t.reshape(-1) for t in tensors]
    return torch.cat(parts + [parts[0].new_zeros(pad)] if pad else parts)


def _split(flat: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    chunks = flat[:sum(p.numel() for p in params)].split([p.numel() for p in params])
    return [c.view_as(p) for c, p in zip(chunks, params)]


@dataclass
class GradSyncs:
    """Several GradSyncs driven as one: the dense parameters over DP, the experts over expert-DP."""
    syncs: list[GradSync]

    @property
    def active(self) -> bool:
        return self.syncs[0].active

    @active.setter
    def active(self, value: bool) -> None:
        for sync in self.syncs:
            sync.active = value

    @property
    def mark(self):
        return self.syncs[0].mark

    @mark.setter
    def mark(self, value) -> None:
        for sync in self.syncs:
            sync.mark = value

    @property
    def all_buckets(self) -> list[Bucket]:
        return [b for sync in self.syncs for b in sync.all_buckets]

    def optimizer_params(self) -> list[nn.Parameter]:
        return [p for sync in self.syncs for p in sync.optimizer_params()]

    def finish(self) -> None:
        for sync in self.syncs:
            sync.finish()

    def gather_params(self) -> None:
        for sync in self.syncs:
            sync.gather_params()

    def watch(self, model: nn.Module) -> None:
        for sync in self.syncs:
            sync.watch(model)

    def gather_stale(self) -> None:
        for sync in self.syncs:
            sync.gather_stale()
