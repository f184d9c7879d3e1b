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
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from syntorch.models.causal import causal_pairs

SDPA = "aten.scaled_dot_product_attention"


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
    """Runs sdpa's own forward and backward unrecorded; records each as a single op."""

    @staticmethod
    def forward(ctx, tracer, kwargs, kept, q, k, v, attn_mask):
        ctx.tracer, ctx.kept = tracer, kept
        with tracer.paused_recording(), torch.enable_grad():
            ctx.inputs = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
            ctx.out, duration_us = tracer.timed(F.scaled_dot_product_attention, *ctx.inputs, attn_mask=attn_mask,
                                                **kwargs)
            out = _fused_layout(ctx.out.detach())
        dense = sdpa_flop_count(q.shape, k.shape, v.shape)
        tracer.record_op(SDPA, [q, k, v, attn_mask], [out], executed(dense, kept, q, k), duration_us=duration_us,
                         dense_flops=dense)
        ctx.saved = (q, k, v)
        return out

    @staticmethod
    def backward(ctx, grad):
        tracer, (q, k, v) = ctx.tracer, ctx.saved
        wanted = [t for t in ctx.inputs if t.requires_grad]
        with tracer.paused_recording():
            found, duration_us = tracer.timed(torch.autograd.grad, ctx.out, wanted, grad)
        found = iter(found)
        grads = [next(found) if t.requires_grad else None for t in ctx.inputs]
        dense = sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape)
        tracer.record_op(SDPA + "_backward", [grad, q, k, v], grads, executed(dense, ctx.kept, q, k),
                         duration_us=duration_us, dense_flops=dense)
        return None, None, None, *grads, None


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


