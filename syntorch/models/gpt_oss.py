"""GPT-OSS's additions to the Llama layout (OpenAI 2025, gpt-oss model card, section 2; HF modeling_gpt_oss.py):
attention sinks and the clamped SwiGLU of its experts. Plain PyTorch."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from syntorch.models.causal import causal_pairs

GPT_OSS_ALPHA = 1.702  # the sigmoid's slope in GPT-OSS's gate: x * sigmoid(1.702 x) (HF GptOssExperts.alpha)


class AttentionSinks(nn.Module):
    """One learned logit per query head (HF self_attn.sinks). A module of its own, so tensor parallelism can give
    each rank its heads' entries by module name as it does for the projections."""

    def __init__(self, n_head: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_head))


def sink_attention(q, k, v, sinks: torch.Tensor, mask, is_causal: bool, **gqa) -> torch.Tensor:
    """Softmax attention whose denominator also holds exp(sinks[h]) for head h. q: [B, H, T, D], k, v:
    [B, H_kv, S, D], sinks: [H], mask as scaled_dot_product_attention takes it (bool, True = attend).

    The sink is one more key, with a zero value: q gets one more dim holding sinks[h] / scale and the keys one
    more dim holding 0, the sink key is (0, .., 0, 1). Its logit is then sinks[h] in every head and for every
    query, the real logits are unchanged, and the whole stays one fused attention call (gradients reach the sinks
    through q), where HF's eager code computes the score matrix."""
    B, H, T, D = q.shape
    S = k.shape[2]
    scale = D ** -0.5
    if is_causal:  # SDPA's causal mask would not see the extra key: spell it out
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        mask.attended_pairs = causal_pairs(T, S)
    q = torch.cat((q, (sinks / scale).to(q.dtype).view(1, H, 1, 1).expand(B, H, T, 1)), -1)  # [B, H, T, D + 1]
    sink_key = F.pad(torch.ones(1, 1, 1, 1, dtype=k.dtype, device=k.device), (D, 0)).expand(B, k.shape[1], 1, D + 1)
    k = torch.cat((F.pad(k, (0, 1)), sink_key), 2)  # [B, H_kv, S + 1, D + 1]
    v = F.pad(v, (0, 0, 0, 1))  # [B, H_kv, S + 1, D]: the sink adds nothing
    if mask is not None:
        kept = getattr(mask, "attended_pairs", None)
        mask = torch.cat((mask, mask.new_ones(*mask.shape[:-1], 1)), -1)  # every query sees the sink
        if kept is not None:  # the tracer's count of the pairs computed (trace/attention.py)
            mask.attended_pairs = kept + T
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **gqa)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """GPT-OSS's expert activation: gate clamped above at `limit`, up to +-limit and shifted by one, so a large
    activation cannot blow up in low precision (HF GptOssExperts.forward)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate * GPT_OSS_ALPHA) * (up + 1)
