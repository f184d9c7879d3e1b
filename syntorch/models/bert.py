"""BERT: post-LayerNorm bidirectional encoder with the masked-LM head."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from syntorch.config import ModelConfig
from syntorch.models.layers import MLP, Attention


class BertLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0):  # built by index like GPT's Block (pipeline stages)
        super().__init__()
        self.attn = Attention(c, layer)
        self.ln1 = nn.LayerNorm(c.d_model, eps=c.ln_eps)
        self.mlp = MLP(c)
        self.ln2 = nn.LayerNorm(c.d_model, eps=c.ln_eps)

    def forward(self, x, mask=None):
        x = self.ln1(x + self.attn(x, mask=mask))  # post-LN, unlike GPT
        return self.ln2(x + self.mlp(x))


class Bert(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = nn.Embedding(c.n_positions, c.d_model)
        self.type_emb = nn.Embedding(c.type_vocab_size, c.d_model)
        self.ln_emb = nn.LayerNorm(c.d_model, eps=c.ln_eps)
        self.layers = nn.ModuleDict({str(i): BertLayer(c) for i in range(c.n_layer)})
        # MLM head: transform (dense, gelu, LayerNorm), then the tied decoder with its own bias
        self.head_dense = nn.Linear(c.d_model, c.d_model)
        self.head_ln = nn.LayerNorm(c.d_model, eps=c.ln_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size)
        self.tie_weights()

    def tie_weights(self):
        """Share the token embedding with the LM head (again, after loading or moving with assign)."""
        if self.config.tied_head:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, x: torch.Tensor, token_type_ids=None, attention_mask=None) -> torch.Tensor:
        """x: token ids [B, T], or, on a pipeline stage without the embeddings, the residual stream [B, T, d]
        the stage before sent; token_type_ids: [B, T] (the first stage reads them); attention_mask: [B, T]
        with 1 for real tokens (every stage needs it). Returns MLM logits [B, T, V], or the stream [B, T, d]
        on a stage without the head."""
        if self.tok_emb is not None:
            x = self._embed(x, token_type_ids)
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]  # [B, 1, 1, T]
        for layer in self.layers.values():  # only the layers this stage holds
            x = layer(x, mask)
        if self.lm_head is None:
            return x
        x = self.head_ln(F.gelu(self.head_dense(x)))
        return self.lm_head(x)

    def _embed(self, idx: torch.Tensor, token_type_ids) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(idx)
        return self.ln_emb(self.tok_emb(idx) + self.pos_emb(positions) + self.type_emb(types))  # [B, T, d]
