"""scaled_dot_product_attention recorded as one fused op (and one backward op), whatever kernel the device
picks (the Tracer's function mode calls `fused_attention`), with the FLOPs a flash kernel spends.

Its FLOPs are the work a flash kernel does: flop_counter's count of the whole score matrix
(`dense_flops` on the op) times the fraction of (query, key) pairs the causal mask keeps (`flops`), the
diagonal included: s(s+1)/2 of s² for is_causal with s queries and keys. FlashAttention skips the masked
blocks (Dao 2023, FlashAttention-2, section 3.1.1; its benchmarks count causal FLOPs as half). A boolean mask
says how many pairs it keeps in `attended_pairs` (causal_pairs; the models' causal-by-slot masks with a KV
cache, context parallelism's): on meta its values are unknown. Any other mask (padding) is counted whole, as
kernels given a dense mask compute it.
"""
import functools

import torch
import torch.nn.functional as F
from torch.utils import flop_counter

from syntorch.models.causal import causal_pairs
from syntorch.trace import meta_cache

SDPA = "aten.scaled_dot_product_attention"
# flop_counter's counts, of shapes only (every layer and micro-batch asks again)
sdpa_flop_count = functools.cache(flop_counter.sdpa_flop_count)
sdpa_backward_flop_count = functools.cache(flop_counter.sdpa_backward_flop_count)


def fused_attention(tracer, q, k, v, attn_mask=None, **kwargs):
    """scaled_dot_product_attention as one op (and one backward op), whatever kernel the device picks."""
    kept = attended_pairs(q.shape[-2], k.shape[-2], kwargs.get("is_causal", False), attn_mask)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _FusedAttention.apply(tracer, kwargs, kept, q, k, v, attn_mask)
    with tracer.paused_recording():
        out, duration_us = tracer.timed(F.scaled_dot_product_attention, q, k, v, attn_mask=attn_mask, **kwargs)
        out = _fused_layout(out)
    dense = sdpa_flop_count(q.shape, k.shape, v.shape)
    tracer.record_op(SDPA, [q, k, v, attn_mask], [out], executed(dense, kept, q, k), duration_us=duration_us,
                     dense_flops=dense)
    return out


class _FusedAttention(torch.autograd.Function):
    """Runs sdpa's own forward and backward unrecorded; records each as a single op. On meta their results'
    layouts are remembered (meta_cache.remember) and rebuilt for the same inputs' layouts: sdpa's math path
    is ~60 dispatched ops a layer."""

    @staticmethod
    def forward(ctx, tracer, kwargs, kept, q, k, v, attn_mask):
        ctx.tracer, ctx.kept, ctx.call = tracer, kept, (attn_mask, kwargs)
        with tracer.paused_recording():
            ctx.inputs = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
            ctx.key = None if tracer.time_ops else meta_cache.memo_key(
                "sdpa", ctx.inputs, [t.requires_grad for t in ctx.inputs], attn_mask, sorted(kwargs.items()))
            found, ctx.out = meta_cache.rebuilt(ctx.key), None
        math, duration_us = (found[0], None) if found else _math_forward(ctx)
        meta_cache.remember(ctx.key, [math], (ctx.inputs, attn_mask))
        with tracer.paused_recording():
            out = _fused_layout(math.detach())
        dense = sdpa_flop_count(q.shape, k.shape, v.shape)
        tracer.record_op(SDPA, [q, k, v, attn_mask], [out], executed(dense, kept, q, k), duration_us=duration_us,
                         dense_flops=dense)
        ctx.saved = (q, k, v)
        return out

    @staticmethod
    def backward(ctx, grad):
        tracer, (q, k, v) = ctx.tracer, ctx.saved
        wanted = [t for t in ctx.inputs if t.requires_grad]
        key = (ctx.key, meta_cache.memo_key(grad)) if ctx.key is not None and grad.is_meta else None
        with tracer.paused_recording():
            found, duration_us = meta_cache.rebuilt(key), None
        if not found:
            if ctx.out is None:  # its forward was rebuilt: run it now for its autograd graph
                _math_forward(ctx)
            with tracer.paused_recording():
                found, duration_us = tracer.timed(torch.autograd.grad, ctx.out, wanted, grad)
            meta_cache.remember(key, found, (ctx.inputs, grad))
        found = iter(found)
        grads = [next(found) if t.requires_grad else None for t in ctx.inputs]
        dense = sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape)
        tracer.record_op(SDPA + "_backward", [grad, q, k, v], grads, executed(dense, ctx.kept, q, k),
                         duration_us=duration_us, dense_flops=dense)
        return None, None, None, *grads, None


def _math_forward(ctx) -> tuple:
    """sdpa's own forward of ctx.inputs, unrecorded, its autograd graph kept for backward (ctx.out); and its
    wall time."""
    attn_mask, kwargs = ctx.call
    with ctx.tracer.paused_recording(), torch.enable_grad():
        ctx.out, duration_us = ctx.tracer.timed(F.scaled_dot_product_attention, *ctx.inputs, attn_mask=attn_mask,
                                                **kwargs)
    return ctx.out, duration_us


def attended_pairs(queries: int, keys: int, is_causal: bool, mask) -> int:
    """The (query, key) pairs per batch row and head that attention computes (module docstring)."""
    if is_causal:  # torch's is_causal: query i attends keys 0..i
        return causal_pairs(queries, keys)
    return getattr(mask, "attended_pairs", queries * keys)


def executed(dense: int, kept: int, q, k) -> int:
    """flop_counter's count over every score, cut to the kept pairs (every FLOP it counts is per score)."""
    return dense // (q.shape[-2] * k.shape[-2]) * kept


def _fused_layout(out: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] stored as [B, T, H, D], as fused kernels (FlashAttention, CPU flash) write it; the math
    path writes [B, H, T, D] contiguous, which would change the ops that follow (a view vs a copy)."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


