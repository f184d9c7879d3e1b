"""Transformer building blocks shared by the GPT and BERT families. Plain PyTorch."""
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from syntorch.config import ModelConfig
from syntorch.models.causal import causal_pairs
from syntorch.models.gpt_oss import AttentionSinks, clamped_swiglu, sink_attention
from syntorch.models.kv_cache import KVCache
from syntorch.models.yarn import yarn_attention_factor, yarn_frequencies


def rope_frequencies(c: ModelConfig, device=None) -> torch.Tensor:
    """The rotary angle per position of each dim pair, [rotary_dims / 2]: theta^(-2i/r), with Llama 3.1's
    scaling (HF's rope_type "llama3") or YaRN's (models/yarn.py) when configured."""
    r = c.rotary_dims
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, r, 2, device=device, dtype=torch.float32) / r))
    if c.rope_scaling == "yarn":
        return yarn_frequencies(inv_freq, c)
    if c.rope_scaling != "llama3":
        return inv_freq
    wavelength = 2 * math.pi / inv_freq
    slow = inv_freq / c.rope_factor  # wavelengths beyond the pre-training context: slowed by the factor
    # between: a blend, 0 at original/low_freq_factor wavelengths, 1 at original/high_freq_factor
    blend = ((c.rope_original_positions / wavelength - c.rope_low_freq_factor)
             / (c.rope_high_freq_factor - c.rope_low_freq_factor)).clamp(0, 1)
    return (1 - blend) * slow + blend * inv_freq


def rotary_tables(positions: torch.Tensor, c: ModelConfig):
    """cos, sin of shape [*positions.shape, rotary_dims] ([T, r], or [B, T, r] for per-row positions), laid out
    for the config's rotary_style."""
    angles = positions.float()[..., None] * rope_frequencies(c, positions.device)  # [..., T, r/2]
    if c.rotary_style == "interleaved":  # GPT-J: dims (2i, 2i+1) share an angle
        angles = angles.repeat_interleave(2, -1)
    else:  # Llama/NeoX: dims i and i + r/2 share one
        angles = torch.cat((angles, angles), -1)
    if c.rope_scaling == "yarn":  # YaRN's attention temperature, on q and k alike (HF's attention_scaling)
        factor = yarn_attention_factor(c)
        return angles.cos() * factor, angles.sin() * factor
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    # x: [B, T, H, D]; rotates the pairs of the first r = rotary_dims dims, as rotary_tables laid them out
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    if style == "interleaved":
        pairs = x_rot.unflatten(-1, (-1, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
    else:
        first, second = x_rot.chunk(2, -1)
        rotated = torch.cat((-second, first), -1)
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)  # [(B,) T, 1, r]: one per head
    return torch.cat((x_rot * cos + rotated * sin, x_pass), -1)


def make_norm(c: ModelConfig) -> nn.Module:
    return nn.RMSNorm(c.d_model, eps=c.ln_eps) if c.norm == "rmsnorm" else nn.LayerNorm(c.d_model, eps=c.ln_eps)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0):
        super().__init__()
        self.d_head, self.n_head, self.n_kv_head = c.d_head, c.n_head, c.kv_heads
        self.causal = c.causal
        self.rotary_style = c.rotary_style
        self.sliding_window = c.layer_window(layer)
        # Qwen3's norms act on each head alone, so they hold d_head weights whatever the heads (or TP shards)
        self.q_norm = nn.RMSNorm(c.d_head, eps=c.ln_eps) if c.qk_norm else None
        self.k_norm = nn.RMSNorm(c.d_head, eps=c.ln_eps) if c.qk_norm else None
        self.sinks = AttentionSinks(c.n_head) if c.attn_sinks else None
        # q, k and v in one matrix laid out [q heads, k heads, v heads] x d_head along the output dim
        self.qkv = nn.Linear(c.d_model, (c.n_head + 2 * c.kv_heads) * c.d_head, bias=c.qkv_bias)
        self.proj = nn.Linear(c.n_head * c.d_head, c.d_model, bias=c.proj_bias)
        self.kv_cache: KVCache | None = None  # attached by the model's setup_caches (kv_cache.py)
        # set from outside when the K/V attention reads are not this layer's own: maps k, v to them (context
        # parallelism gathers every rank's: parallel/context.py)
        self.kv_gather: nn.Module | None = None

    def local_heads(self, qkv_heads: int) -> tuple[int, int]:
        """(query heads, K/V heads) of a qkv output holding `qkv_heads` heads in all: the model's, or one TP
        rank's: n_head/tp query heads with n_kv_head/tp K/V heads, or with one K/V head when tp exceeds n_kv_head
        (replicated, as Megatron and vLLM do; then fewer than one K/V head's worth is left by the formula)."""
        if self.n_kv_head == self.n_head:  # thirds: one division (a captured decode step runs each as an op)
            third = qkv_heads // 3
            return third, third
        kv = max(1, self.n_kv_head * qkv_heads // (self.n_head + 2 * self.n_kv_head))
        return qkv_heads - 2 * kv, kv

    def new_cache(self, batch: int, max_seq: int, dtype) -> KVCache:
        """A cache of this layer's K/V heads only (grouped-query attention), and this rank's, so a TP-sharded
        qkv works."""
        weight = self.qkv.weight
        _, n_kv = self.local_heads(weight.shape[0] // self.d_head)
        shape = (batch, n_kv, max_seq, self.d_head)
        return KVCache(shape, shape, dtype, weight.device)

    def keys_values(self, start: int, k: torch.Tensor, v: torch.Tensor):
        """The keys and values attention reads, from this step's k, v [B, H, T, D] at slots start..: gathered
        (kv_gather), or after those the cache holds (kv_cache), or as they are."""
        if self.kv_gather is not None:
            return self.kv_gather(k, v)
        if self.kv_cache is not None:
            return self.kv_cache.update(start, k, v)
        return k, v

    def forward(self, x, start: int = 0, rope=None, mask=None):
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, -1, self.d_head)
        # the head counts come from the output, so a sharded qkv works unchanged
        n_q, n_kv = self.local_heads(qkv.shape[2])
        q, k, v = qkv.split((n_q, n_kv, n_kv), dim=2)  # [B, T, H, D], K/V with n_kv heads
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope, self.rotary_style), apply_rotary(k, *rope, self.rotary_style)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        k, v = self.keys_values(start, k, v)
        mask, is_causal = self.attention_mask(start, T, k.shape[2], mask, x.device)
        gqa = {"enable_gqa": True} if n_q != n_kv else {}  # each K/V head serves n_q / n_kv query heads
        if self.sinks is not None:
            y = sink_attention(q, k, v, self.sinks.weight, mask, is_causal, **gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **gqa)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))

    def attention_mask(self, start: int, T: int, keys: int, mask, device):
        """(mask, is_causal) for T queries at cache slots start.. over `keys` keys: a given mask as it is, else
        SDPA's own causal mask when queries and keys coincide, else causal by slot; narrowed to the sliding window
        where it cuts. Slot distance is position distance, also in left-padded rows, so the window works on slots."""
        window = self.sliding_window if 0 < self.sliding_window < start + T else 0
        if not window and (mask is not None or not self.causal or T == 1):
            return mask, False
        if not window and keys == T:
            return None, True
        q_slot = torch.arange(start, start + T, device=device)[:, None]
        k_slot = torch.arange(keys, device=device)[None, :]
        allowed = k_slot <= q_slot
        if window:
            allowed = allowed & (q_slot - k_slot < window)
        if mask is not None:
            return mask & allowed, False
        allowed.attended_pairs = causal_pairs(T, keys, start, window)  # the tracer's FLOPs (meta has no values)
        return allowed, False


_ACTIVATIONS = {"gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


class MLP(nn.Module):
    """fc2(act(fc1 x)) (GPT, BERT), or gated (SwiGLU: Llama, and each Mixtral expert) fc2(act(gate) * up) with
    fc1 x = [gate; up] fused, as Megatron's linear_fc1 (HF's gate_proj and up_proj). `d_ff` overrides the
    config's (MoE experts have their own size)."""

    def __init__(self, c: ModelConfig, d_ff: int = 0):
        super().__init__()
        d_ff = d_ff or c.d_ff
        self.gated = c.gated_mlp
        self.swiglu_limit = c.swiglu_limit  # GPT-OSS's clamp; 0: none
        self.fc1 = nn.Linear(c.d_model, (2 if c.gated_mlp else 1) * d_ff, bias=c.mlp_bias)
        self.fc2 = nn.Linear(d_ff, c.d_model, bias=c.mlp_bias)
        self.act = _ACTIVATIONS[c.activation]

    def forward(self, x):
        h = self.fc1(x)
        if self.gated:
            gate, up = h.chunk(2, -1)  # halves of the local output, so a TP-sharded fc1 works unchanged
            h = clamped_swiglu(gate, up, self.swiglu_limit) if self.swiglu_limit else self.act(gate) * up
        else:
            h = self.act(h)
        return self.fc2(h)


def init_weights(module: nn.Module, std: float = 0.02, residual_layers: int = 0):
    """GPT-2/BERT initialisation: N(0, std) weights, zero biases, unit LayerNorms. With `residual_layers`
    = n_layer, GPT-2's scaling too (Radford et al. 2019, section 2.3; GPT-3 keeps it; nanoGPT's c_proj): the
    projections that add into the residual stream (attn.proj, mlp.fc2) get std / sqrt(2 * n_layer), as the
    stream sums two of them per layer. BERT has no such scaling (HF's BertPreTrainedModel)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        if isinstance(m, nn.RMSNorm):
            nn.init.ones_(m.weight)
        if isinstance(m, AttentionSinks):  # as HF inits GPT-OSS's sinks
            nn.init.normal_(m.weight, std=std)
        if hasattr(m, "e_score_correction_bias"):  # DeepSeek-V3's router: no correction before training sets one
            nn.init.zeros_(m.e_score_correction_bias)
    if not residual_layers:
        return
    for m in module.modules():  # a second pass: the first reaches attn.proj after attn and would undo it
        out = m.proj if isinstance(m, Attention) else m.fc2 if isinstance(m, MLP) else None
        if out is not None:
            nn.init.normal_(out.weight, std=std / math.sqrt(2 * residual_layers))
