"""Gradient clipping by the global norm, where Megatron-LM does it: after the gradients are reduced, before the
optimizer step (`--clip_grad`, 1.0 by default as Megatron's; 0 turns it off).

Each rank sums the squares of the gradients it alone accounts for (one multi-tensor pass, as Megatron's
multi_tensor_l2norm), one all-reduce sums them over the ranks that together hold one copy of every gradient,
and every gradient is multiplied by min(1, clip / (norm + 1e-6)) (torch's clip_grad_norm_; Megatron skips the
product when the factor is 1). Which ranks and which gradients (Megatron's get_grad_norm_fp32 over
get_grad_stats_parallel_group):
- DDP: the model-parallel group (TP x PP): DP and CP replicas hold the same gradients once reduced.
- ZeRO 1/2 and FSDP (Megatron's distributed optimizer), and experts over DP (EP): every rank, each over its
  shard (or, DDP with EP, every DP rank over the replicas it holds).
A gradient several ranks of that group hold whole counts once: Megatron counts a parameter every TP rank
holds (LayerNorms, row-parallel biases, position tables) on TP rank 0 only (param_is_not_tensor_parallel_
duplicate) and a head tied to the embedding on the first stage only (param_is_not_shared). Here the tied head
is left out the same way, but a replica's square is divided by its copies on every rank that holds it, so
the ranks of a stage do the same work (syntorch traces a stage once for all of them); in a flat shard, whose
layout differs between DP ranks, as a weight per element (`shard_weights`). (With more TP ranks than K/V
heads the replicated K/V rows inside the QKV weight are counted on every rank.)
"""
import torch
import torch.nn as nn

from syntorch.parallel import distributed as comm
from syntorch.parallel.fsdp import FullyShard

# TP styles (tensor.py) that split every parameter of their module; "rowwise" splits the weight, not the bias
SHARDED = frozenset({"vocab_embedding", "colwise_qkv", "colwise", "colwise_gated", "vocab_head"})


def tp_replicated(model: nn.Module, styles: dict[str, str]) -> frozenset[int]:
    """Ids of the parameters every TP rank holds whole, by the styles TP applied (before later wrappers
    rename modules)."""
    ids = set()
    for name, module in model.named_modules():
        style = styles.get(name)
        for pname, p in module.named_parameters(recurse=False):
            if style not in SHARDED and not (style == "rowwise" and pname != "bias"):
                ids.add(id(p))
    return frozenset(ids)


def clip_factor(run, max_norm: float, inv_scale: float = 1.0) -> torch.Tensor | None:
    """min(1, max_norm / (norm + 1e-6)) for the step's reduced gradients (`inv_scale`: fp16's loss scale
    undone), a 0-dim FP32 tensor; None when clipping is off."""
    if not max_norm:
        return None
    whole, weighted = norm_parts(run)
    sums = []
    for copies, grads in whole.items():
        squares = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()
        sums.append(squares if copies == 1 else squares / copies)
    for grad, weights in weighted:  # a flat shard: each element's square times its weight (shard_weights)
        sums.append((grad.float().square() * weights).sum() / run.plan.tp)
    local = sums[0] if len(sums) == 1 else torch.stack(sums).sum() if sums else torch.zeros(
        (), device=run.grad_sync.optimizer_params()[0].device)
    group, size = norm_group(run)
    if size > 1:
        local = comm.all_reduce(local, "sum", group)
    norm = local.sqrt() if inv_scale == 1.0 else local.sqrt() * inv_scale
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def norm_group(run) -> tuple[object, int]:
    """(group, size) the squared norms are summed over (module docstring)."""
    plan, groups = run.plan, run.groups
    if plan.zero or plan.ep > 1:
        return groups.world, plan.mesh.world_size
    return groups.model_parallel, plan.tp * plan.pp


def copies_of(model: nn.Module, plan, groups, replicated: frozenset) -> dict[int, int]:
    """id(parameter) -> how many ranks of the norm's group hold it whole, for those held more than once: TP
    replicas (tp), and 0 for a tied head off the first stage (left out)."""
    copies = dict.fromkeys(replicated, plan.tp) if plan.tp > 1 else {}
    if groups.embedding is not None and groups.stage != 0:
        copies[id(_tied(model))] = 0
    return copies


def shard_weights(sync, copies: dict[int, int], tp: int) -> dict[int, torch.Tensor]:
    """id(flat shard) -> an integer weight per element (tp / copies, 0 to leave out) for the flat shards
    (ZeRO's, FSDP's units) that hold a parameter counted other than once. Built once with the plan: a
    shard's layout differs between DP ranks, so per-parameter slices would make their traces differ."""
    if isinstance(sync, FullyShard):
        flats = [(unit.shard, [unit.params], comm.rank_in(unit.group), [unit.shard.numel()]) for unit in sync.units]
    else:
        flats = [(s.shard, [b.params for b in s.all_buckets], comm.rank_in(s.dp_group),
                  [b.size // s.dp for b in s.all_buckets]) for s in getattr(sync, "syncs", [sync]) if s.shard is not None]
    out = {}
    for shard, pieces, rank, sizes in flats:
        runs = list(_runs(pieces, rank, sizes, copies))
        if runs:
            weights = torch.full((shard.numel(),), tp, dtype=torch.uint8, device=shard.device)
            for a, b, c in runs:
                weights[a:b] = tp // c if c else 0
            out[id(shard)] = weights
    return out


def norm_parts(run) -> tuple[dict[int, list[torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """What this rank sums: ({copies: whole gradients}, [(flat shard gradient, its weights)]). A replica's
    square is divided by its copies, so every rank of a stage does the same work (a stage is traced once
    for all its ranks)."""
    plan, sync = run.plan, run.grad_sync
    copies = copies_of(run.model, plan, run.groups, run.tp_replicated)
    whole, weighted = {}, []
    shards = [u.shard for u in sync.units] if isinstance(sync, FullyShard) else [
        s.shard for s in getattr(sync, "syncs", [sync]) if s.shard is not None]
    for shard in shards:
        if shard.grad is None:
            continue
        if id(shard) in run.norm_weights:
            weighted.append((shard.grad, run.norm_weights[id(shard)]))
        else:
            whole.setdefault(1, []).append(shard.grad)
    if shards or isinstance(sync, FullyShard):
        return whole, weighted
    world = plan.zero or plan.ep > 1
    for s in getattr(sync, "syncs", [sync]):
        replicas = s.dp if world else 1  # DDP under the world group: every DP (expert-DP) rank holds them
        for p in s.params:
            n = copies.get(id(p), 1) * replicas
            if n and p.grad is not None:
                whole.setdefault(n, []).append(p.grad)
    return whole, weighted


def _tied(model: nn.Module) -> nn.Parameter:
    params = dict(model.named_parameters())
    return params["lm_head.weight" if "lm_head.weight" in params else "tok_emb.weight"]


def _runs(pieces: list[list[nn.Parameter]], rank: int, sizes: list[int], copies: dict):
    """(start, end, copies) in a flat shard -- this rank's slice `sizes[i]` long of each piece (parameters
    flattened one after the other, padded) -- of the parameters counted other than once."""
    base = 0
    for params, n in zip(pieces, sizes):
        lo, start = rank * n, 0
        for p in params:
            end = start + p.numel()
            if id(p) in copies and start < lo + n and end > lo:
                yield base + max(start, lo) - lo, base + min(end, lo + n) - lo, copies[id(p)]
            start = end
        base += n
