"""Multi-head Latent Attention (DeepSeek-V2, arXiv 2405.04434 §2.1; DeepSeek-V3). Plain PyTorch.

Per token: the query through a low-rank down-projection q_a (q_lora_rank), an RMSNorm and an up-projection q_b
to every head's [no-rope | rope] dims (or one full-rank projection `q` without q LoRA); K/V through kv_a to a
latent of kv_lora_rank plus one rotary key of rotary_dim dims shared by all heads; the latent through an RMSNorm
and kv_b to every head's no-rope key and value. Scores are q_nope.k_nope + q_rope.k_rope over d_head dims.

The KV cache holds what MLA exists to keep small: the normed latent and the rotated shared key (kv_lora_rank +
rotary_dim numbers per token and layer, not 2 x heads x head dims). A forward of several tokens re-expands K/V
from it (kv_b over every cached position: the "naive" form of DeepSeek's inference code, vLLM's prefill path);
a one-token decode step uses the absorbed form instead (DeepSeek's "absorb", vLLM's decode path): kv_b's key
half is folded into the query and its value half applied after attention, so attention runs over the latent
itself as one shared K/V head. Both give the same logits (they reassociate the same products).

Names match the HF modules (q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
o_proj) one for one: q_a, q_norm, q_b, kv_a, kv_norm, kv_b, proj.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from syntorch.config import ModelConfig
from syntorch.models.kv_cache import KVCache
from syntorch.models.layers import Attention, apply_rotary
from syntorch.models.yarn import yarn_mscale

LATENT_EPS = 1e-6  # the latent norms' epsilon: HF builds them with its default, not rms_norm_eps


class MLA(Attention):
    """An Attention (same kv_cache and kv_gather slots, masks and place in the block) with MLA's projections."""

    def __init__(self, c: ModelConfig):
        nn.Module.__init__(self)  # none of Attention's projections: MLA has its own
        self.n_head, self.d_head, self.v_head_dim = c.n_head, c.d_head, c.value_head_dim
        self.rope_dim, self.latent = c.rotary_dim, c.kv_lora_rank
        self.nope_dim = c.d_head - c.rotary_dim
        self.causal, self.sliding_window, self.rotary_style = c.causal, c.sliding_window, c.rotary_style
        if c.q_lora_rank:
            self.q_a = nn.Linear(c.d_model, c.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(c.q_lora_rank, eps=LATENT_EPS)
            self.q_b = nn.Linear(c.q_lora_rank, c.n_head * c.d_head, bias=False)
        else:
            self.q = nn.Linear(c.d_model, c.n_head * c.d_head, bias=False)
        self.kv_a = nn.Linear(c.d_model, c.kv_lora_rank + c.rotary_dim, bias=False)
        self.kv_norm = nn.RMSNorm(c.kv_lora_rank, eps=LATENT_EPS)
        self.kv_b = nn.Linear(c.kv_lora_rank, c.n_head * (self.nope_dim + self.v_head_dim), bias=False)
        self.proj = nn.Linear(c.n_head * self.v_head_dim, c.d_model, bias=False)
        self.scale = c.d_head ** -0.5
        if c.rope_scaling == "yarn" and c.yarn_softmax_mscale and c.rope_mscale_all_dim:
            self.scale *= yarn_mscale(c.rope_factor, c.rope_mscale_all_dim) ** 2
        self.kv_cache: KVCache | None = None  # attached by the model's setup_caches (kv_cache.py)
        self.kv_gather: nn.Module | None = None  # as Attention's

    def new_cache(self, batch: int, max_seq: int, dtype) -> KVCache:
        """The normed latent [B, 1, S, kv_lora_rank] as K and the rotated shared key [B, 1, S, rotary_dim] as V,
        whole on every TP rank."""
        return KVCache((batch, 1, max_seq, self.latent), (batch, 1, max_seq, self.rope_dim), dtype,
                       self.kv_a.weight.device)

    def forward(self, x, start: int = 0, rope=None, mask=None):
        B, T, _ = x.shape
        q = self.q_b(self.q_norm(self.q_a(x))) if hasattr(self, "q_a") else self.q(x)
        q = q.view(B, T, -1, self.d_head)  # this rank's heads under TP: the count comes from the output
        q_nope, q_rope = q.split((self.nope_dim, self.rope_dim), -1)
        latent, k_rope = self.kv_a(x).split((self.latent, self.rope_dim), -1)
        latent = self.kv_norm(latent)[:, None]  # [B, 1, T, latent]: one "head"
        q_rope = apply_rotary(q_rope, *rope, self.rotary_style).transpose(1, 2)  # [B, H, T, rope]
        # [B, 1, T, rope]: one rotary key shared by the heads
        k_rope = apply_rotary(k_rope[:, :, None], *rope, self.rotary_style).transpose(1, 2)
        latent, k_rope = self.keys_values(start, latent, k_rope)
        mask, is_causal = self.attention_mask(start, T, latent.shape[2], mask, x.device)
        attend = self._absorbed if self.kv_cache is not None and T == 1 else self._expanded
        y = attend(q_nope.transpose(1, 2), q_rope, latent, k_rope, mask, is_causal)  # [B, H, T, v_head_dim]
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))

    def _expanded(self, q_nope, q_rope, latent, k_rope, mask, is_causal):
        # per-head keys and values from the latent of every position (Megatron-Core and HF compute it so)
        B, H, _, _ = q_nope.shape
        kv = self.kv_b(latent[:, 0]).view(B, latent.shape[2], H, -1).transpose(1, 2)  # [B, H, S, nope + v]
        k_nope, v = kv.split((self.nope_dim, self.v_head_dim), -1)
        q = torch.cat((q_nope, q_rope), -1)
        k = torch.cat((k_nope, k_rope.expand(-1, H, -1, -1)), -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale)

    def _absorbed(self, q_nope, q_rope, latent, k_rope, mask, is_causal):
        # q_nope . (W_uk c) = (W_uk^T q_nope) . c: attention over [latent | rope] as one K/V head, then W_uv
        H = q_nope.shape[1]
        w = self.kv_b.weight.view(H, self.nope_dim + self.v_head_dim, self.latent)
        w_uk, w_uv = w.split((self.nope_dim, self.v_head_dim), 1)
        q = torch.cat((q_nope @ w_uk, q_rope), -1)  # [B, H, T, latent + rope]
        k = torch.cat((latent, k_rope), -1)  # [B, 1, S, latent + rope]
        y = F.scaled_dot_product_attention(q, k, latent, attn_mask=mask, is_causal=is_causal, scale=self.scale,
                                           enable_gqa=True)  # [B, H, T, latent]
        return y @ w_uv.transpose(1, 2)  # [B, H, T, v_head_dim]
