"""Megatron tensor parallelism applied to a finished plain model, in place.

As in gpt-fast's tp.py the model knows nothing of ranks: apply_tp swaps the Linear/Embedding modules named
in the plan for parallel ones holding this rank's shard (same module and parameter names, so traces and
state dicts keep their keys). As in torchtitan the plan is data, {module suffix: style}:

- colwise_qkv / colwise_gated / colwise: output features split (q, k and v each by heads, K/V heads replicated
  when TP exceeds their count, as Megatron and vLLM do; a SwiGLU fc1's gate and up halves each). Megatron's f
  before: identity forward, all-reduce of the gradient backward.
- rowwise: input features split; g after: all-reduce forward; the bias is added once, after it.
- heads: a per-query-head parameter (GPT-OSS's attention sinks) keeps this rank's heads' entries.
- vocab_embedding: rows of the padded vocabulary split; masked lookup, then all-reduce.
- vocab_head: local logits of the padded vocabulary, all-gathered, padding sliced off before sampling; in
  training they stay sharded for the vocabulary-parallel loss (loss.py).

MoE layers (Megatron's MoE under TP without EP): each expert's MLP (and the shared experts') is sharded like the
dense MLP and the router is replicated, but the whole MoE layer is one TP region: f before it, g (one all-reduce)
after it, none per expert, since every rank routes the same tokens and the weighted sum of partial expert
outputs is itself a partial sum. The router's gradients are then partial too; training sums them over TP
(`partial_grads`). Expert parallelism, which splits the experts instead, is a plan of its own.

Multi-head Latent Attention (DeepSeek) shards by heads as Megatron-Core's MLA does: the down-projections (q_a,
kv_a) and the latent norms replicated, the up-projections (q_b, or q without q LoRA, and kv_b) column-parallel by
heads, the output row-parallel; every rank caches the whole latent. The layer is one TP region like an MoE layer
(f before, g after): the shared rotary key feeds every rank's heads, so its gradient, like the replicated
down-projections', is partial per rank; `partial_grads` sums them (Megatron-Core instead puts f before each
up-projection and reduces the rotary key's part on its own; the sums are the same).

Sequence parallel (Korthikanti et al. 2022) keeps the residual stream and LayerNorms split along the sequence:
each all-reduce becomes a reduce-scatter (row-parallel outputs, the embedding) plus an all-gather (before a
column-parallel layer). A forward whose length does not divide by the TP degree (a one-token decode step)
runs plain TP. Which, is decided once per forward at the model's entry (`_enter_forward`, a pre-hook apply_tp
puts on the model) from what the forward is given: token ids [B, T] are split when T divides by the TP
degree; a stream [B, T/t, d] another pipeline stage sent is split whenever SP is on (training plans check
that T divides; inference refuses SP with PP). The model's parallel modules read that decision (`Sequence`);
nothing else sets it.
"""
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.parallel import distributed as comm

TP_PLAN = {
    "tok_emb": "vocab_embedding",
    "attn.qkv": "colwise_qkv",
    "attn.proj": "rowwise",
    "attn.sinks": "heads",
    "fc1": "colwise",  # every MLP's: dense, each MoE expert's, the shared experts'
    "fc2": "rowwise",
    "lm_head": "vocab_head",
}
# sequence parallel also splits what is added to the embedding and gathers the sequence where attention and
# the MLP start (they need all positions; the gather stands where Megatron's f does); the head gathers its own
SP_PLAN = {"pos_emb": "sequence_split", "type_emb": "sequence_split", "attn": "sequence_gather_input",
           "mlp": "sequence_gather_input"}
VOCAB_MULTIPLE = 128  # Megatron pads the vocabulary to a multiple of 128 * tp


@dataclass
class Sequence:
    """The sequence of the model's current forward: whether its stream is split along it over the TP group,
    and its whole length. Set by the model's entry only (`_enter_forward`)."""
    split: bool = False
    length: int = 0


@dataclass
class TPGroup:
    """What every parallel module of one model shares: the group, and the sequence of the current forward."""
    group: object  # torch ProcessGroup (None: the whole world)
    rank: int
    size: int
    sequence_parallel: bool = False
    sequence: Sequence = field(default_factory=Sequence)


@dataclass
class TPPlan:
    """What apply_tp did: the styles it applied and the local (per-rank) shapes. The config stays global."""
    tp: int
    rank: int
    sequence_parallel: bool
    padded_vocab: int
    styles: dict[str, str] = field(default_factory=dict)  # module name -> style
    local_shapes: dict[str, tuple] = field(default_factory=dict)  # parameter name -> shape on this rank
    # replicated parameters that under SP see only this rank's positions: training sums their grads over TP
    partial_grads: list[str] = field(default_factory=list)


def check_tp(config: ModelConfig, tp: int) -> None:
    """TP splits heads and FFN columns evenly (K/V heads may instead be replicated); say in one line when it cannot."""
    c = config
    if tp > c.n_head:
        raise UserError(f"--tp {tp} is larger than {c.name}'s {c.n_head} attention heads; "
                        f"use a --tp that divides {c.n_head}")
    ffn = {c.d_ff} if not c.n_experts else {c.expert_d_ff, c.expert_d_ff * c.n_shared_experts} - {0}
    if c.n_experts and c.first_k_dense:  # DeepSeek's dense first layers
        ffn.add(c.d_ff)
    for what, n in (("attention heads", c.n_head), *(("FFN size", d) for d in sorted(ffn))):
        if n % tp:
            fits = [d for d in range(1, c.n_head + 1) if all(x % d == 0 for x in (c.n_head, *ffn)) and _kv_fits(c, d)]
            raise UserError(f"--tp {tp} does not divide {c.name}'s {what} ({n}); "
                            f"choose --tp from {', '.join(map(str, fits))}")
    if not _kv_fits(c, tp):
        raise UserError(f"--tp {tp} neither divides nor is a multiple of {c.name}'s {c.kv_heads} K/V heads; "
                        "each rank must hold whole K/V heads or one replicated K/V head")


def _kv_fits(c: ModelConfig, tp: int) -> bool:
    return c.kv_heads % tp == 0 or tp % c.kv_heads == 0


def check_sp(sp: bool, tp: int, seq: int | None = None) -> None:
    """Sequence parallelism splits TP regions along the sequence: it needs a TP group (and, for a fixed
    sequence length, one that divides it)."""
    if sp and tp == 1:
        raise UserError("--sp (sequence parallel) splits TP regions along the sequence; it needs --tp > 1")
    if sp and seq is not None and seq % tp:
        raise UserError(f"--sp needs --seq ({seq}) divisible by --tp ({tp})")


def padded_vocab(vocab_size: int, tp: int) -> int:
    step = VOCAB_MULTIPLE * tp
    return -(-vocab_size // step) * step


def plan_for(model: nn.Module, sequence_parallel: bool) -> dict[str, str]:
    """{module name: style} for this model: every module whose name ends with a plan key."""
    gated = {"fc1": "colwise_gated"} if model.config.gated_mlp else {}
    moe = {"mlp": "moe_region"} if model.config.n_experts else {}  # every block's MLP is an MoE layer (or a dense
    # one as its own region: the same f and g)
    mla = {"attn": "moe_region", "attn.q": "colwise", "attn.q_b": "colwise", "attn.kv_b": "colwise"} \
        if model.config.mla else {}
    # a region (MoE layer, MLA attention) gathers its own input under SP: its style wins over SP_PLAN's
    rules = {**TP_PLAN, **gated, **(SP_PLAN if sequence_parallel else {}), **moe, **mla}
    plan = {}
    for name, _ in model.named_modules():
        for suffix, style in rules.items():
            if name == suffix or name.endswith("." + suffix):
                plan[name] = style
    return plan


# -- sharding: one function for in-memory weights and lazily opened checkpoints ----------------------------

def _shape(full) -> tuple:
    return tuple(full.shape) if isinstance(full, torch.Tensor) else tuple(full.get_shape())


def _vocab_rows(full, rank: int, size: int, vocab_pad: int) -> torch.Tensor:
    # rows [rank * local, (rank + 1) * local) of the vocabulary padded with zeros to vocab_pad
    shape, local = _shape(full), vocab_pad // size
    start = rank * local
    n = max(0, min(shape[0], start + local) - start)
    rows = full[start:start + n] if n else full[0:0]  # a rank may hold padding only
    pad = torch.zeros((local - n, *shape[1:]), dtype=rows.dtype, device=rows.device)
    return torch.cat((rows, pad)) if local > n else rows


def _split_blocks(full, blocks: tuple, unit: int, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s part of each of the consecutive row blocks of `full` (sizes in units of `unit` rows): an
    even share, or, for a block of fewer units than ranks, the one unit rank * units // size (replicated)."""
    parts, start = [], 0
    for units in blocks:
        first, count = rank * units // size, max(1, units // size)
        parts.append(full[start + first * unit:start + (first + count) * unit])
        start += units * unit
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def take_shard(style: str, param: str, full, rank: int, size: int, vocab_pad: int, d_head: int,
               kv_heads: int = 0) -> torch.Tensor:
    """This rank's part of the full tensor `full` (a tensor, or a safetensors slice read lazily).

    `param` is "weight" or "bias" of a module with that style; `kv_heads`: the model's K/V heads (0: as many
    as query heads).
    """
    shape = _shape(full)
    if style in ("colwise", "heads"):
        return _split_blocks(full, (shape[0],), 1, rank, size)
    if style == "colwise_gated":  # out dim laid out [gate; up]: our columns of each
        return _split_blocks(full, (shape[0] // 2,) * 2, 1, rank, size)
    if style == "colwise_qkv":  # out dim laid out [q heads, k heads, v heads] x d_head: our heads of each
        kv = kv_heads or shape[0] // (3 * d_head)
        return _split_blocks(full, (shape[0] // d_head - 2 * kv, kv, kv), d_head, rank, size)
    if style == "rowwise":
        if param == "bias":  # added once, after the all-reduce
            return full[:]
        n = shape[1] // size
        return full[:, rank * n:(rank + 1) * n]
    if style in ("vocab_embedding", "vocab_head"):
        return _vocab_rows(full, rank, size, vocab_pad)
    return full[:]  # replicated


# -- the parallel modules -------------------------------------------------------------------------------

def _param(t: torch.Tensor | None, like: nn.Parameter | None):
    return None if t is None else nn.Parameter(t.contiguous(), requires_grad=like.requires_grad)


class ColumnParallelLinear(nn.Module):
    def __init__(self, weight, bias, tp: TPGroup, in_region: bool = False):
        super().__init__()
        self.weight, self.bias, self.tp = weight, bias, tp
        self.in_region = in_region  # inside an MoE layer, whose own f reduces the gradient

    def forward(self, x):  # x: [B, T, d]
        if not (self.tp.sequence.split or self.in_region):  # under SP the all-gather before attn/mlp already does
            x = comm.copy_to_tp(x, self.tp.group)
        return F.linear(x, self.weight, self.bias)  # [B, T, out/tp]


class RowParallelLinear(nn.Module):
    def __init__(self, weight, bias, tp: TPGroup, in_region: bool = False):
        super().__init__()
        self.weight, self.bias, self.tp = weight, bias, tp
        self.in_region = in_region  # inside an MoE layer: leave the partial sums to its one all-reduce

    def forward(self, x):  # x: [B, T, in/tp]
        y = F.linear(x, self.weight)  # partial sums [B, T, out]
        if self.in_region:  # the bias once: on rank 0, before the sum; times 0 elsewhere, so that every rank has
            # a gradient for it (summed over TP as a partial one: GPT-OSS's expert biases)
            return y if self.bias is None else y + self.bias * (self.tp.rank == 0)
        if self.tp.sequence.split:
            y = comm.reduce_scatter_to_sp(y, 1, self.tp.group)  # [B, T/tp, out]
        else:
            y = comm.reduce_from_tp(y, self.tp.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight, tp: TPGroup):
        super().__init__()
        self.weight, self.tp = weight, tp
        self.vocab_start = tp.rank * weight.shape[0]

    def forward(self, idx):  # idx: [B, T] global token ids
        tp = self.tp
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0)  # [B, T, d], rows other ranks hold are zero
        return comm.reduce_scatter_to_sp(x, 1, tp.group) if tp.sequence.split else comm.reduce_from_tp(x, tp.group)


class VocabParallelHead(nn.Module):
    def __init__(self, weight, bias, vocab_size: int, tp: TPGroup):
        super().__init__()
        self.weight, self.bias, self.vocab_size, self.tp = weight, bias, vocab_size, tp
        self.gather = True  # False: return this rank's logits (loss.sharded_logits)

    def forward(self, x):  # x: [B, T, d] (sequence-split under SP) -> logits [B, T, vocab_size] on every rank
        tp = self.tp
        if tp.sequence.split:
            x = comm.gather_from_sp(x, 1, tp.group)
            # the model kept each shard's last position (last_only): the true last is the last shard's. With one
            # position per shard (T == tp) the two look alike: all come through and the model keeps the last
            if x.shape[1] != tp.sequence.length:
                x = x[:, -1:]
        else:
            x = comm.copy_to_tp(x, tp.group)
        logits = F.linear(x, self.weight, self.bias)  # [B, T, V_pad/tp]
        if not self.gather:
            return logits
        return comm.gather_from_tp(logits, -1, self.tp.group)[..., :self.vocab_size]


def _build(style: str, module: nn.Module, tp: TPGroup, vocab_pad: int, config: ModelConfig,
           in_region: bool = False) -> nn.Module:
    def shard(param):
        full = getattr(module, param, None)
        if full is None:
            return None
        return _param(take_shard(style, param, full.detach(), tp.rank, tp.size, vocab_pad, config.d_head,
                                 config.kv_heads), full)

    if style in ("colwise", "colwise_gated", "colwise_qkv"):
        return ColumnParallelLinear(shard("weight"), shard("bias"), tp, in_region)
    if style == "rowwise":
        return RowParallelLinear(shard("weight"), shard("bias"), tp, in_region)
    if style == "vocab_embedding":
        return VocabParallelEmbedding(shard("weight"), tp)
    if style == "vocab_head":
        return VocabParallelHead(shard("weight"), shard("bias"), config.vocab_size, tp)
    if style == "heads":  # the module stays; its weight shrinks to this rank's heads
        module.weight = shard("weight")
    if style == "sequence_split":  # replicated table; keep this rank's positions
        module.register_forward_hook(
            lambda m, inp, out: comm.split_to_sp(out, -2, tp.group) if tp.sequence.split else out)
    elif style == "sequence_gather_input":
        module.register_forward_pre_hook(
            lambda m, args: (comm.gather_from_sp(args[0], 1, tp.group), *args[1:]) if tp.sequence.split else args)
    elif style == "moe_region":  # f and g around the region; under SP the all-gather and reduce-scatter of
        # the sequence instead (Megatron-Core's all-gather token dispatcher for TP-split experts)
        module.register_forward_pre_hook(lambda m, args: (_region_input(args[0], tp), *args[1:]))
        module.register_forward_hook(lambda m, inp, out: _region_output(out, tp))
    return module


def _region_input(x, tp: TPGroup):
    return comm.gather_from_sp(x, 1, tp.group) if tp.sequence.split else comm.copy_to_tp(x, tp.group)


def _region_output(y, tp: TPGroup):
    return comm.reduce_scatter_to_sp(y, 1, tp.group) if tp.sequence.split else comm.reduce_from_tp(y, tp.group)


def resolve_group(mesh_or_group):
    """A MeshGroups (its TP group), a ProcessGroup, or None for the whole world."""
    return getattr(mesh_or_group, "tp", mesh_or_group)


def apply_tp(model: nn.Module, mesh_or_group=None, sequence_parallel: bool = False) -> TPPlan:
    """Shard `model` in place over the TP group; returns the plan with local shapes. The config is not touched."""
    group = resolve_group(mesh_or_group)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    config = model.config
    check_tp(config, size)
    tp = TPGroup(group, rank, size, sequence_parallel)
    plan = TPPlan(size, rank, sequence_parallel, padded_vocab(config.vocab_size, size),
                  styles=plan_for(model, sequence_parallel))
    regions = [name for name, style in plan.styles.items() if style == "moe_region"]
    for name, style in plan.styles.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        in_region = any(name.startswith(region + ".") for region in regions)
        setattr(parent, child, _build(style, getattr(parent, child), tp, plan.padded_vocab, config, in_region))
    model.tie_weights()  # the head and the embedding hold the same vocabulary rows
    # a closure, not a bound method: pipeline chunk views (module_view) copy the hook and must share `tp`
    model.register_forward_pre_hook(lambda m, args, kwargs: _enter_forward(tp, args[0] if args else kwargs["x"]),
                                    with_kwargs=True)
    plan.local_shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    if sequence_parallel:
        plan.partial_grads = _partial_params(model, plan.styles)
    elif regions:
        plan.partial_grads = _partial_params(model, plan.styles, regions)
    # Qwen3's q/k norms are replicated, yet each rank normalizes only its own heads: their gradients are partial too
    per_head = [n for n, _ in model.named_parameters() if re.search(r"\.attn\.[qk]_norm\.", n)]
    plan.partial_grads += [n for n in per_head if n not in plan.partial_grads]
    return plan


def _enter_forward(tp: TPGroup, x: torch.Tensor) -> None:
    """The sequence of the forward the model starts on `x`: token ids [B, T], or the stream [B, T', d] a
    pipeline stage received, split along T whenever SP is on (module docstring)."""
    if x.is_floating_point():
        split = tp.sequence_parallel
        tp.sequence = Sequence(split, x.shape[1] * (tp.size if split else 1))
    else:
        tp.sequence = Sequence(tp.sequence_parallel and x.shape[1] % tp.size == 0, x.shape[1])


def _partial_params(model: nn.Module, styles: dict[str, str], regions: list[str] | None = None) -> list[str]:
    # replicated parameters whose gradient each rank holds a part of: under SP (every parameter but the
    # position/type tables, split, then gathered in backward) each rank sees only its positions: LayerNorms,
    # BERT's head transform, row-parallel biases; in MoE `regions` the router and the biases of the row-parallel
    # layers see only this rank's partial expert outputs
    names = []
    for name, module in model.named_modules():
        if regions is not None and not any(name.startswith(region + ".") for region in regions):
            continue
        style = styles.get(name)
        names += [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)
                  if style is None or (style == "rowwise" and p == "bias")]
    return names


def reduce_partial_grads(model: nn.Module, plan: TPPlan, group=None) -> None:
    """After backward under SP: sum over the TP group the gradients of the parameters in plan.partial_grads."""
    params = dict(model.named_parameters())
    for name in plan.partial_grads:
        if params[name].grad is not None:
            comm.all_reduce(params[name].grad, "sum", resolve_group(group))
