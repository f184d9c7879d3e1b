"""Sparse mixture-of-experts MLP (Mixtral; DeepSeekMoE with shared experts and DeepSeek's routers). Plain PyTorch.

A router Linear scores the E experts for each token; each token goes to its top-k experts and their outputs
are summed with the softmax weights, renormalized over the chosen k as HuggingFace's MixtralSparseMoeBlock
does (softmax in float32, top-k, divide by the sum, cast back). No capacity limit: no token is dropped.
Experts are a ModuleList of ordinary MLPs, so a tensor-parallel plan shards each like the dense MLP and an
expert-parallel plan can hand each rank a subset of them.
"""
import torch
import torch.nn as nn

from syntorch.config import ModelConfig
from syntorch.models.layers import MLP
from syntorch.models.router import DeepSeekRouter


class MoE(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.top_k = c.moe_top_k
        self.renormalize = c.moe_renormalize
        # HF "gate". GPT-OSS's has a bias and takes the softmax over the top-k logits, which is this softmax over all
        # renormalized over the top k (the same k win either way, and exp(l_i) / sum_k exp(l_j) = p_i / sum_k p_j).
        # DeepSeek's routers (router.py) choose the experts themselves
        self.router = (DeepSeekRouter(c) if c.moe_topk_method
                       else nn.Linear(c.d_model, c.n_experts, bias=c.router_bias))
        self.experts = nn.ModuleList(MLP(c, c.expert_d_ff) for _ in range(c.n_experts))
        # DeepSeekMoE's shared experts: one MLP as wide as all of them, every token, unweighted
        self.shared = MLP(c, c.n_shared_experts * c.expert_d_ff) if c.n_shared_experts else None
        # symbolic runs have no values to route by: tokens per expert as fractions of all (token, expert) pairs;
        # None: uniform
        self.symbolic_load: list[float] | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, d] -> (weights [N, k] in x's dtype, expert ids [N, k])."""
        if isinstance(self.router, DeepSeekRouter):
            return self.router.route(x)
        probs = self.router(x).softmax(-1, dtype=torch.float32)  # [N, E]
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts

    def tokens_per_expert(self, experts: torch.Tensor) -> list[int]:
        """How many (token, slot) pairs each expert gets, from the chosen ids [N * k]; on meta, from the stated
        load (uniform by default), rounded by largest remainder (ties to the lower expert)."""
        n_experts = self.router.out_features  # E, also on an expert-parallel rank holding fewer
        if not experts.is_meta:
            return torch.bincount(experts, minlength=n_experts).tolist()
        total = experts.numel()
        shares = [total * share for share in (self.symbolic_load or [1 / n_experts] * n_experts)]
        counts = [int(share) for share in shares]
        by_remainder = sorted(range(n_experts), key=lambda e: counts[e] - shares[e])
        for e in by_remainder[:total - sum(counts)]:
            counts[e] += 1
        return counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        x = x.reshape(B * T, d)
        weights, experts = self.route(x)  # [N, k] each
        order = experts.flatten().argsort(stable=True)  # (token, slot) pairs grouped by expert
        token = order // self.top_k  # [N * k]: the token of each pair, in that order
        counts = self.tokens_per_expert(experts.flatten())
        routed = x[token].split(counts)  # one [n_e, d] block per expert
        # an expert no token chose does no work (as in HF); tensor-parallel ranks route alike and skip alike
        y = torch.cat([expert(block) for expert, block in zip(self.experts, routed) if len(block)])  # [N * k, d]
        y = y * weights.flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, token, y)  # each token's sum over its k experts
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(B, T, d)
