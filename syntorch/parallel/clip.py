"""Gradient clipping by the global norm, where Megatron-LM does it: after the gradients are reduced, before the
optimizer step (`--clip_grad`, 1.0 by default as Megatron's; 0 turns it off).

Each rank sums the squares of the gradients it alone accounts for (one multi-tensor pass, as Megatron's
multi_tensor_l2norm), one all-reduce sums them over the ranks that together hold one copy of every gradient,
and every gradient is multiplied by min(1, clip / (norm + 1e-6)) (torch's clip_grad_norm_; Megatron skips the
product when the factor is 1). Which ranks and which gradients (Megatron's get_grad_norm_fp32 over
get_grad_stats_parallel_group):
- DDP: the model-parallel group (TP x PP): DP and CP replicas hold the same gradients once reduced. A
  parameter every TP rank holds whole (LayerNorms, row-parallel biases, position tables) counts on TP rank 0
  only (Megatron's param_is_not_tensor_parallel_duplicate); a head tied to the embedding on the first stage
  only (param_is_not_shared).
- ZeRO 1/2 and FSDP (Megatron's distributed optimizer): every rank, each over its shard, with the same two
  exclusions cut out of the flat shards; with experts over DP (EP) every rank too, each replicated gradient
  counted on its first DP (or expert-DP) rank.
(With more TP ranks than K/V heads the replicated K/V rows inside the QKV weight are counted on every rank.)
"""
import torch
import torch.nn as nn

from syntorch.parallel import comm
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
    local = torch.zeros((), device=run.grad_sync.optimizer_params()[0].device)
    for copies, grads in norm_parts(run).items():
        squares = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()
        local = local + (squares if copies == 1 else squares / copies)
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


def norm_parts(run) -> dict[int, list[torch.Tensor]]:
    """The gradients (or shard slices) this rank sums, by how many ranks of the norm's group hold each: a
    replica's squares are divided by that count, so every rank of a stage does the same work (a stage is
    traced once for all its ranks). A tied head off the first stage is left out."""
    groups, plan = run.groups, run.plan
    tp = dict.fromkeys(run.tp_replicated, plan.tp) if plan.tp > 1 else {}
    if groups.embedding is not None and groups.stage != 0:
        tp[id(_tied(run.model))] = 0  # 0: not counted here
    sync, parts = run.grad_sync, {}
    if isinstance(sync, FullyShard):
        for unit in sync.units:
            if unit.shard.grad is not None:
                _slices(parts, unit.shard.grad, [unit.params], comm.rank_in(unit.group), tp)
        return parts
    world = plan.zero or plan.ep > 1
    for s in getattr(sync, "syncs", [sync]):
        if s.shard is not None:
            _slices(parts, s.shard.grad, [b.params for b in s.all_buckets], comm.rank_in(s.dp_group), tp,
                    [b.size // s.dp for b in s.all_buckets])
            continue
        replicas = s.dp if world else 1  # DDP under the world group: every DP (expert-DP) rank holds them
        for p in s.params:
            copies = tp.get(id(p), 1) * replicas
            if copies and p.grad is not None:
                parts.setdefault(copies, []).append(p.grad)
    return parts


def _tied(model: nn.Module) -> nn.Parameter:
    params = dict(model.named_parameters())
    return params["lm_head.weight" if "lm_head.weight" in params else "tok_emb.weight"]


def _slices(parts: dict, grad: torch.Tensor, pieces: list[list[nn.Parameter]], rank: int, copies: dict,
            sizes: list[int] | None = None) -> None:
    """Views of `grad`, a flat shard made of this rank's slice of each piece (parameters flattened one after
    the other, padded; a slice `sizes[i]` long, default the shard's length), into `parts` by the copies of
    the parameters they cover (`copies`: id -> count, 0 to leave out; others 1)."""
    sizes = sizes or [grad.numel()]
    runs, base = [], 0  # (start, end, copies) in shard positions
    for params, n in zip(pieces, sizes):
        lo, start = rank * n, 0
        for p in params:
            end = start + p.numel()
            if start < lo + n and end > lo:
                runs.append((base + max(start, lo) - lo, base + min(end, lo + n) - lo, copies.get(id(p), 1)))
            start = end
        base += n
    runs.append((runs[-1][1] if runs else 0, grad.numel(), 1))  # padding: zeros
    a = 0
    for i, (_, end, c) in enumerate(runs):
        if i + 1 == len(runs) or runs[i + 1][2] != c:  # a run of equal counts ends here: one view
            if c and end > a:
                parts.setdefault(c, []).append(grad[a:end])
            a = end
