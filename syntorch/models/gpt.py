"""Decoder-only family, chosen by ModelConfig flags: GPT-2, GPT-3 (learned positions, sequential residual, tied
head), GPT-J (interleaved rotary, parallel residual, untied head with bias), and the Llama layout (RMSNorm,
rotate-half rotary with Llama 3.1's scaling, grouped-query attention, SwiGLU, no biases, untied head) with
Mistral's sliding window, Qwen2's QKV biases and Mixtral's mixture-of-experts MLP; Qwen3's q/k norms; GPT-OSS's
alternating windows, attention sinks, biased experts with a clamped SwiGLU and YaRN rotary; DeepSeek-V2/V3's latent
attention (mla.py), dense first layers and routers (router.py)."""
import torch
import torch.nn as nn

from syntorch.config import ModelConfig
from syntorch.models.kv_cache import DecoderCaches
from syntorch.models.layers import MLP, Attention, make_norm, rotary_tables
from syntorch.models.mla import MLA
from syntorch.models.moe import MoE


class Block(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0):
        super().__init__()
        self.parallel_residual = c.parallel_residual
        self.ln1 = make_norm(c)
        # the layer index picks its window (GPT-OSS alternates)
        self.attn = MLA(c) if c.mla else Attention(c, layer)
        # GPT-J feeds attention and MLP from the same LayerNorm, so it has no second one
        self.ln2 = None if c.parallel_residual else make_norm(c)
        # DeepSeek keeps the first `first_k_dense` layers dense
        self.mlp = MoE(c) if c.n_experts and layer >= c.first_k_dense else MLP(c)

    def forward(self, x, start: int = 0, rope=None, mask=None):
        h = self.ln1(x)
        if self.parallel_residual:
            return x + self.attn(h, start, rope, mask) + self.mlp(h)
        x = x + self.attn(h, start, rope, mask)
        return x + self.mlp(self.ln2(x))


class GPT(DecoderCaches, nn.Module):
    """The decoder; its KV-cache methods (setup_caches, reorder_caches, cache_rows, reset_caches) come from
    kv_cache.DecoderCaches."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = nn.Embedding(c.n_positions, c.d_model) if c.pos == "learned" else None
        # a ModuleDict keeps names like layers.3 when a pipeline stage drops other layers
        self.layers = nn.ModuleDict({str(i): Block(c, i) for i in range(c.n_layer)})
        self.ln_f = make_norm(c)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=c.head_bias)
        self.tie_weights()

    def tie_weights(self):
        """Share the token embedding with the LM head (again, after loading or moving with assign)."""
        if self.config.tied_head:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, x: torch.Tensor, start: int = 0, last_only: bool = False,
                seq_len: int | None = None, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: token ids [B, T] at positions start..start+T, or, on a pipeline stage without the embeddings,
        the residual stream [B, T, d] the stage before sent. `seq_len`: the sequence's length when x holds
        only part of it (a stream split along T); positions come from it. `start` is where the tokens go in
        the KV cache. `positions` ([T] or [B, T]): each token's position, for the embeddings and rotary, when
        it is not its cache slot (left-padded rows, non-contiguous chunks); `mask` (bool, broadcastable to
        [B, 1, T, keys], True = attend) replaces the causal mask in every layer. Returns logits [B, T, V]
        ([B, 1, V] if last_only), or the stream [B, T, d] on a stage without the head."""
        learned = self.pos_emb is not None  # a later pipeline stage has none: the stream it gets holds them
        rotary = self.config.pos == "rotary"  # every stage needs the tables, for its own layers
        T = seq_len or x.shape[1]
        if positions is None and (learned or rotary):
            positions = torch.arange(start, start + T, device=x.device)
        if self.tok_emb is not None:
            x = self.tok_emb(x)  # [B, T, d]
        if learned:
            x = x + self.pos_emb(positions)
        rope = rotary_tables(positions, self.config) if rotary else None
        for block in self.layers.values():  # only the layers this stage holds
            x = block(x, start, rope, mask)
        if self.lm_head is None:
            return x
        if last_only:  # the head's work for one position only
            x = x[:, -1:]
        logits = self.lm_head(self.ln_f(x))
        # a head that gathers a stream split along T gets each part's last position and cannot tell, when every
        # part holds one, whether it was sliced: keep the last here, where last_only is known
        return logits[:, -1:] if last_only and logits.shape[1] > 1 else logits
