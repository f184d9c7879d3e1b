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
default; moe_load.py) on every rank: every rank routes alike, so each rank receives, from every rank of its
EP group, its own experts' share of the rows, and the all-to-all sizes are exact for it (under a skewed
load, ranks holding busy experts receive more: moe_load.py groups them into kinds).
Expert gradients are reduced over the expert-data-parallel group (plans.py); they already sum the tokens of
every rank of the EP group, so they are averaged over all DP x CP ranks as the dense ones are.

The experts' own TP size (--etp, Megatron-Core's --expert-tensor-parallel-size; mesh.py lays out the groups)
may be smaller than TP: then an expert is sharded over etp ranks only (whole for etp = 1) and the EP group
takes in the tp / etp TP ranks of each expert-TP position. Those ranks hold the same tokens (no sequence
parallelism for MoE layers here), so each routes its own 1/(tp/etp) slice of them, and returns the MoE
output for its slice only (zeros elsewhere): the MoE layer stays one TP region (tensor.py: f before it, g's
all-reduce after it), whose sum over the TP group adds every slice's rows once, each already summed over its
etp shards. Megatron-Core splits the tokens over TP by sequence parallelism instead (it requires it with
MoE and TP), then all-gathers within the expert-TP group; the rows each expert sees are the same.
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.models.moe import MoE
from syntorch.parallel import distributed as comm
from syntorch.parallel.tensor import ColumnParallelLinear, RowParallelLinear, TPGroup, take_shard


def check_ep(config: ModelConfig, ep: int) -> None:
    if ep == 1:
        return
    if not config.n_experts:
        raise UserError(f"--ep {ep} splits the experts of a mixture-of-experts model; {config.name} has none")
    if config.n_experts % ep:
        raise UserError(f"--ep {ep} must divide the {config.n_experts} experts of {config.name}")


def check_etp(config: ModelConfig, etp: int, tp: int, ep: int, tokens: int) -> None:
    """--etp other than --tp: what it needs of the model and the plan (module docstring). `tokens`: a
    micro-batch's tokens on one rank, which the tp / etp ranks sharing them split."""
    if etp == tp:
        return
    if ep == 1:
        raise UserError(f"--etp {etp} differs from --tp {tp}: the ranks it frees hold other experts, which needs "
                        "--ep > 1")
    if config.expert_d_ff % etp:
        raise UserError(f"--etp {etp} must divide {config.name}'s expert FFN size ({config.expert_d_ff})")
    if 1 < etp and config.mlp_bias:
        raise UserError(f"{config.name}'s experts have biases, which --etp between 1 and --tp ({etp}) would replicate "
                        f"over part of TP; use --etp 1 or --etp {tp}")
    if tokens % (tp // etp):
        raise UserError(f"--tp {tp} / --etp {etp} = {tp // etp} ranks split each micro-batch's {tokens} tokens "
                        "for the experts; make micro_batch_size * seq / cp divide by it")


@contextmanager
def experts_aside(model: nn.Module, aside: bool = True):
    """The MoE layers' experts out of `model` while TP shards the rest (with --etp they are sharded over the
    expert-TP ranks instead: shard_experts), back in place after."""
    moes = [m for m in model.modules() if isinstance(m, (MoE, ExpertParallelMoE))] if aside else []
    kept = [m.experts for m in moes]
    for m in moes:
        m.experts = nn.ModuleList()
    try:
        yield
    finally:
        for m, experts in zip(moes, kept):
            m.experts = experts


def shard_experts(model: nn.Module, etp: int, etp_rank: int) -> None:
    """Each expert's fc1 column-parallel and fc2 row-parallel over `etp` ranks, as TP shards a dense MLP, all
    inside the MoE layer's TP region (no collective of their own: the region's all-reduce sums the partial
    outputs); whole for etp = 1."""
    if etp == 1:
        return
    shards = TPGroup(None, etp_rank, etp)
    for moe in [m for m in model.modules() if isinstance(m, (MoE, ExpertParallelMoE))]:
        for mlp in moe.experts:
            gated = "colwise_gated" if mlp.gated else "colwise"
            for name, style, parallel in (("fc1", gated, ColumnParallelLinear), ("fc2", "rowwise", RowParallelLinear)):
                linear = getattr(mlp, name)
                weight = take_shard(style, "weight", linear.weight.detach(), etp_rank, etp, 0, 0)
                setattr(mlp, name, parallel(nn.Parameter(weight.contiguous()), None, shards, in_region=True))


class ExpertParallelMoE(nn.Module):
    """A MoE layer holding experts first_expert .. first_expert + L - 1 of the EP group's E. With `slices` > 1
    (--etp below --tp) it routes slice `slice` of its tokens only (module docstring)."""

    def __init__(self, moe: MoE, group, slices: int = 1, slice: int = 0):
        super().__init__()
        self.slices, self.slice = slices, slice
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
        whole = x = x.reshape(B * T, d)
        mine = B * T // self.slices  # tokens this rank routes
        if self.slices > 1:
            x = x.narrow(0, self.slice * mine, mine)
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
        if self.slices > 1:  # this slice's rows; the other slices' ranks add theirs in the region's all-reduce
            out = F.pad(out, (0, 0, self.slice * mine, (self.slices - 1 - self.slice) * mine))
        if self.shared is not None:
            out = out + self.shared(whole)
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


def apply_ep(model: nn.Module, group, slices: int = 1, slice: int = 0) -> None:
    """Swap every MoE layer of `model` for its expert-parallel share over `group` (in place); `slices`,
    `slice`: ExpertParallelMoE's."""
    check_ep(model.config, dist.get_world_size(group))
    for name, module in list(model.named_modules()):
        if isinstance(module, MoE):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, ExpertParallelMoE(module, group, slices, slice))


def is_expert_param(name: str) -> bool:
    return ".experts." in name
