"""DeepSeek's MoE routers (DeepSeek-V2 §2.2, DeepSeek-V3 §2.1.2), as transformers 4.57 computes them
(DeepseekV2MoEGate, DeepseekV3TopkRouter). Plain PyTorch.

A Linear over the experts, in float32 like HF's, then per token:
- "greedy" (V2-Lite): softmax scores, top-k;
- "group_limited_greedy" (V2's device-limited routing): softmax scores; the experts in moe_n_group equal groups,
  each group ranked by its best score; top-k among the moe_topk_group best groups;
- "noaux_tc" (V3's auxiliary-loss-free balancing): sigmoid scores; selection by score + e_score_correction_bias
  (a buffer that training nudges per expert; it chooses, it never weighs), groups ranked by the sum of their two
  best biased scores; weights are the unbiased scores, renormalized when moe_renormalize (norm_topk_prob).
Weights are then multiplied by moe_routed_scale (routed_scaling_factor).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from syntorch.config import ModelConfig


class DeepSeekRouter(nn.Linear):
    def __init__(self, c: ModelConfig):
        super().__init__(c.d_model, c.n_experts, bias=False)  # HF "gate"
        self.method, self.top_k, self.renormalize = c.moe_topk_method, c.moe_top_k, c.moe_renormalize
        self.n_group, self.topk_group, self.scale = c.moe_n_group, c.moe_topk_group, c.moe_routed_scale
        if self.method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(c.n_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, d] -> (weights [N, k] in x's dtype, expert ids [N, k])."""
        logits = F.linear(x.float(), self.weight.float())
        if self.method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            group_score = choice.unflatten(-1, (self.n_group, -1)).topk(2, dim=-1).values.sum(-1)
        else:
            scores = choice = logits.softmax(-1)
            group_score = choice.unflatten(-1, (self.n_group, -1)).amax(-1)
        if self.method != "greedy":  # experts outside the best groups score 0 (as in HF, also below negatives)
            best = group_score.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(scores.shape[-1] // self.n_group, -1), 0.0)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)  # HF's epsilon
        return (weights * self.scale).to(x.dtype), experts
