"""The collectives, one interface over torch.distributed, real or symbolic.

Real: the process group torchrun (or launch.spawn) set up, gloo on CPU and NCCL on CUDA.
Symbolic: torch's "fake" backend, which accepts every collective on CPU or meta tensors without processes and
without moving or reducing data. Both run the same c10d ops, so a tracer sees the same collectives either way.

Every function takes `group` (a ProcessGroup; None is the whole world) and works on any tensor shape. The
Megatron helpers at the bottom are autograd-aware: their backward runs the conjugate collective, so training
traces show the backward all-reduces.
"""
import contextlib
import sys

import torch
import torch.distributed as dist

from syntorch.errors import UserError

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN,
              "max": dist.ReduceOp.MAX, "prod": dist.ReduceOp.PRODUCT}


def _reduce_op(op: str):
    if op not in REDUCE_OPS:
        raise UserError(f"unknown reduce op '{op}'; choose one of: {', '.join(REDUCE_OPS)}")
    return REDUCE_OPS[op]


def world_size(group=None) -> int:
    return dist.get_world_size(group)


def rank_in(group=None) -> int:
    return dist.get_rank(group)


def all_reduce(x: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """Reduces x across the group in place and returns it. gloo and NCCL both reduce AVG natively here."""
    dist.all_reduce(x, op=_reduce_op(op), group=group)
    return x


def all_gather(x: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """Every rank's x concatenated along `dim`, in group-rank order."""
    n = world_size(group)
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x.contiguous(), group=group)
    if dim % x.dim() == 0:
        return out
    return torch.cat(out.chunk(n), dim)


def reduce_scatter(x: torch.Tensor, dim: int = 0, op: str = "sum", group=None) -> torch.Tensor:
    """x reduced across the group, then split along `dim`: group rank i keeps chunk i."""
    n = world_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} does not divide by {n} ranks")
    stacked = x.contiguous() if dim % x.dim() == 0 else torch.cat(x.chunk(n, dim))
    out = x.new_empty((stacked.shape[0] // n, *stacked.shape[1:]))
    dist.reduce_scatter_single(out, stacked, op=_reduce_op(op), group=group)
    return out


def broadcast(x: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Overwrites x with the copy on global rank `src`, in place."""
    dist.broadcast(x, src=src, group=group)
    return x


def send(x: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    dist.send(x.contiguous(), dst=dst, group=group, tag=tag)


def isend(x: torch.Tensor, dst: int, group=None, tag: int = 0):
    """A send that does not wait for its recv (gloo's send does); returns the work to wait on."""
    return dist.isend(x.contiguous(), dst=dst, group=group, tag=tag)


def recv(x: torch.Tensor, src: int, group=None, tag: int = 0) -> torch.Tensor:
    """Fills x (already the right shape) from global rank `src`."""
    dist.recv(x, src=src, group=group, tag=tag)
    return x


def all_to_all(x: torch.Tensor, group=None, out_splits: list[int] | None = None,
               in_splits: list[int] | None = None) -> torch.Tensor:
    """Chunk i of x (along dim 0) goes to group rank i; chunk j of the result came from group rank j. Equal
    chunks by default; `in_splits` (rows sent to each rank) and `out_splits` (rows received from each) for
    variable ones, as MoE dispatch needs."""
    rows = x.shape[0] if out_splits is None else sum(out_splits)
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def barrier(group=None) -> None:
    dist.barrier(group=group)


@contextlib.contextmanager
def symbolic_world(rank: int, world: int):
    """A process group of `world` ranks seen from `rank`, with no processes: collectives record, move nothing.

    torch's fake backend is an internal module; this is the one place syntorch touches it.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("symbolic_world: a process group is already initialized in this process")
    hook = sys.excepthook  # init_process_group wraps it in one more "[rankN]: " prefix each time
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def own_chunk(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's equal part of x along dim. One narrow, so every rank's trace has the same op structure
    (chunk()[rank] would make all parts and pick one by rank)."""
    size = x.shape[dim] // world_size(group)
    return x.narrow(dim, rank_in(group) * size, size)


# Megatron's conjugate pairs (Shoeybi et al. 2019, f and g; Korthikanti et al. 2022 for sequence parallel).
# Each forward collective has the backward that makes the gradient right on every rank.

class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward (before a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), "sum", ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward (after a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.mark_dirty(x)
        return all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along `dim` forward; backward keeps this rank's chunk of the gradient."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return own_chunk(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward (row-parallel output under SP)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromSP(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward (column-parallel input under SP)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.dim, "sum", ctx.group), None, None


class _SplitToSP(torch.autograd.Function):
    """Keep this rank's chunk along the sequence forward (no communication), all-gather backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return own_chunk(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    """Variable all-to-all forward; the gradients go back the way the rows came (splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return all_to_all(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.group, *ctx.splits), None, None, None


def all_to_all_autograd(x, out_splits: list[int], in_splits: list[int], group=None):
    return _AllToAll.apply(x, out_splits, in_splits, group)


def copy_to_tp(x, group=None):
    # inference needs no identity op in its trace; only a gradient makes f do anything
    return _CopyToTP.apply(x, group) if torch.is_grad_enabled() and x.requires_grad else x


def reduce_from_tp(x, group=None):
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x, dim, group=None):
    return _GatherFromTP.apply(x, dim, group)


def reduce_scatter_to_sp(x, dim, group=None):
    return _ReduceScatterToSP.apply(x, dim, group)


def gather_from_sp(x, dim, group=None):
    return _GatherFromSP.apply(x, dim, group)


def split_to_sp(x, dim, group=None):
    return _SplitToSP.apply(x, dim, group)
