"""Expert parallelism applied to a finished plain model, in place: each MoE layer keeps its share of the
experts and exchanges routed tokens with the rest of its EP group by all-to-all (GShard, Lepikhin et al.
2020; Megatron-Core's MoE token dispatcher "alltoall").

Per MoE layer and forward, on every rank of the EP group (ep ranks, E experts, L = E / ep each, rank r owning
experts r*L .. r*L+L-1; the router is replicated):
1. route this rank's tokens (top-k of E) and sort the (token, slot) pairs by expert;
2. all-to-all of the token counts per expert ([ep, L] integers), so each rank learns how many rows it gets;
3. all-to-all of the rows (variable splits) to the experts' owners; each owner regroups them by local expert,
   runs its experts, and undoes the regrouping;
4. the reverse all-to-all brings every row home, where the top-k outputs are weighted and summed.
Backward runs the conjugate all-to-alls (comm.all_to_all_autograd).

A symbolic (meta) run has no router values: it assumes the stated load (MoE.symbolic_load, uniform by
default) on every rank, so each rank receives what it sends and the all-to-all sizes are exact for it.
Expert gradients are reduced over the expert-data-parallel group (plans.py); they already sum every EP rank's
tokens, so they are averaged over all dp ranks as the dense ones are.
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.models.moe import MoE
from syntorch.parallel import comm


def check_ep(config: ModelConfig, ep: int) -> None:
    if ep == 1:
        return
    if not config.n_experts:
        raise UserError(f"--ep {ep} splits the experts of a mixture-of-experts model; {config.name} has none")
    if config.n_experts % ep:
        raise UserError(f"--ep {ep} must divide the {config.n_experts} experts of {config.name}")


class ExpertParallelMoE(nn.Module):
    """A MoE layer holding experts first_expert .. first_expert + L - 1 of the EP group's E."""

    def __init__(self, moe: MoE, group):
        super().__init__()
        self.ep, self.rank, self.group = dist.get_world_size(group), dist.get_rank(group), group
        self.n_experts, self.top_k, self.renormalize = len(moe.experts), moe.top_k, moe.renormalize
        per_rank = self.n_experts // self.ep
        self.first_expert = self.rank * per_rank
        self.router, self.shared, self.symbolic_load = moe.router, moe.shared, moe.symbolic_load
        self.experts = nn.ModuleList(moe.experts[self.first_expert:self.first_expert + per_rank])

    route = MoE.route
    tokens_per_expert = MoE.tokens_per_expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        x = x.reshape(B * T, d)
        weights, experts = self.route(x)
        order = experts.flatten().argsort(stable=True)
        token = order // self.top_k
        counts = self.tokens_per_expert(experts.flatten())  # [E] (token, slot) pairs per global expert
        per_rank = len(self.experts)
        send = [sum(counts[r * per_rank:(r + 1) * per_rank]) for r in range(self.ep)]
        received = self._exchange_counts(counts, x.device)  # [ep][L]: rows from each rank for each local expert
        recv = [sum(row) for row in received]
        rows = comm.all_to_all_autograd(x[token], recv, send, self.group)  # grouped by source rank, then expert
        blocks = rows.split([n for row in received for n in row])
        outputs = [expert(torch.cat(blocks[e::per_rank])) for e, expert in enumerate(self.experts)]
        # back to source-major order: source s's rows for expert e are the s-th piece of expert e's output
        pieces = [out.split([row[e] for row in received]) for e, out in enumerate(outputs)]
        back = torch.cat([pieces[e][s] for s in range(self.ep) for e in range(per_rank)])
        y = comm.all_to_all_autograd(back, send, recv, self.group)  # in the order the rows were sent
        y = y * weights.flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, token, y)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(B, T, d)

    def _exchange_counts(self, counts: list[int], device) -> list[list[int]]:
        """How many rows each EP rank sends to each of this rank's experts. Real: an all-to-all of the counts
        (Megatron's dispatcher does the same before the rows); symbolic: every rank routes alike, so what it
        gets is what this rank sends to the same experts of its own."""
        per_rank = len(self.experts)
        table = torch.tensor(counts, dtype=torch.long, device=device)  # counts is a list on meta too
        exchanged = comm.all_to_all(table.view(self.ep, per_rank), self.group)
        if exchanged.is_meta:
            mine = counts[self.first_expert:self.first_expert + per_rank]
            return [list(mine) for _ in range(self.ep)]
        return exchanged.tolist()


def apply_ep(model: nn.Module, group) -> None:
    """Swap every MoE layer of `model` for its expert-parallel share over `group` (in place)."""
    check_ep(model.config, dist.get_world_size(group))
    for name, module in list(model.named_modules()):
        if isinstance(module, MoE):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, ExpertParallelMoE(module, group))


def is_expert_param(name: str) -> bool:
    return ".experts." in name
