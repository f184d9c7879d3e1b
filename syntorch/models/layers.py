"""Transformer building blocks shared by the GPT and BERT families. Plain PyTorch."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from syntorch.config import ModelConfig


class KVCache(nn.Module):
    """A preallocated cache: decode writes one position in place, never concatenates."""

    def __init__(self, batch: int, n_head: int, max_seq: int, d_head: int, dtype, device):
        super().__init__()
        shape = (batch, n_head, max_seq, d_head)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.rows: torch.Tensor | None = None  # set by reorder, applied by the next update

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor):
        # k, v: [B, H, T, D] for positions start..start+T; returns the cache up to start+T
        if self.rows is not None:
            self.k.copy_(self.k.index_select(0, self.rows))
            self.v.copy_(self.v.index_select(0, self.rows))
            self.rows = None
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def reorder(self, index: torch.Tensor):
        """Beam search: row b of the cache becomes row index[b], when the layer next runs (so the copy is
        part of the layer's work, as in every layer's step)."""
        self.rows = index


def rotary_tables(positions: torch.Tensor, rotary_dim: int):
    """cos, sin of shape [*positions.shape, rotary_dim] ([T, r], or [B, T, r] for per-row positions) for
    GPT-J's interleaved rotary embedding (base 10000)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.float32) / rotary_dim))
    angles = positions.float()[..., None] * inv_freq  # [..., T, rotary_dim/2]
    return angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, H, D]; rotates pairs (x0, x1), (x2, x3), ... of the first rotary_dim dims
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    pairs = x_rot.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)  # [(B,) T, 1, r]: one per head
    return torch.cat((x_rot * cos + rotated * sin, x_pass), -1)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.d_head = c.d_head
        self.causal = c.causal
        # q, k and v in one matrix laid out [3, heads, d_head] along the output dim
        self.qkv = nn.Linear(c.d_model, 3 * c.n_head * c.d_head, bias=c.qkv_bias)
        self.proj = nn.Linear(c.n_head * c.d_head, c.d_model, bias=c.proj_bias)
        self.kv_cache: KVCache | None = None  # attached by generate.setup_caches

    def forward(self, x, start: int = 0, rope=None, mask=None):
        B, T, _ = x.shape
        # the head count comes from the weight, so a sharded qkv works unchanged
        q, k, v = self.qkv(x).view(B, T, 3, -1, self.d_head).unbind(2)  # each [B, T, H, D]
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(start, k, v)
        is_causal = self.causal and T > 1 and mask is None
        if is_causal and k.shape[2] != T:  # a chunk after cached positions: causal w.r.t. absolute positions
            q_pos = torch.arange(start, start + T, device=x.device)
            mask = torch.arange(k.shape[2], device=x.device)[None, :] <= q_pos[:, None]
            is_causal = False
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


_ACTIVATIONS = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


class MLP(nn.Module):
    """fc2(act(fc1 x)) (GPT, BERT), or gated (SwiGLU: Llama, and each Mixtral expert) fc2(act(gate x) * fc1 x).
    `d_ff` overrides the config's (MoE experts have their own size)."""

    def __init__(self, c: ModelConfig, d_ff: int = 0):
        super().__init__()
        d_ff = d_ff or c.d_ff
        self.gate = nn.Linear(c.d_model, d_ff, bias=c.mlp_bias) if c.gated_mlp else None  # HF gate_proj (w1)
        self.fc1 = nn.Linear(c.d_model, d_ff, bias=c.mlp_bias)  # HF up_proj (w3) when gated
        self.fc2 = nn.Linear(d_ff, c.d_model, bias=c.mlp_bias)
        self.act = _ACTIVATIONS[c.activation]

    def forward(self, x):
        h = self.fc1(x)
        h = self.act(h) if self.gate is None else self.act(self.gate(x)) * h
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
    if not residual_layers:
        return
    for m in module.modules():  # a second pass: the first reaches attn.proj after attn and would undo it
        out = m.proj if isinstance(m, Attention) else m.fc2 if isinstance(m, MLP) else None
        if out is not None:
            nn.init.normal_(out.weight, std=std / math.sqrt(2 * residual_layers))
