"""Per-rank memory of a training step, estimated: what a rank of each pipeline stage holds at its peak.

- weights: the stage's parameters as the rank holds them (TP shards of the layers it owns, the embedding on
  the first stage, the head on the last), counted from the stage model built on meta, in the model dtype;
- gradients: one per parameter in the model dtype (syntorch keeps `.grad` whole, under ZeRO too), plus under
  ZeRO the reduced shard (1/dp);
- optimizer: AdamW's two moments over what the rank updates: every parameter, or under ZeRO its 1/dp shard,
  in FP32, and in fp16/bf16 its FP32 master copy too (12 bytes per updated element, as Megatron's 16 bytes
  per parameter less weight and gradient); under ZeRO also the shard itself in the model dtype;
- activations: what backward needs of one layer and one micro-batch, after Korthikanti et al. 2022
  ("Reducing Activation Recomputation in Large Transformer Models", section 4.1): s·b·h·34 + 5·a·s²·b bytes
  with 16-bit activations, dropout and unfused attention. Counted here per tensor, so it holds for any
  element size: 16 activations of s·b·h elements per layer (2 layer-norm inputs and outputs, Q, K, V, the
  attention output, the MLP's 4h input and output). The rest of the 34 and the 5·a·s²·b are dropout masks
  and attention scores, which syntorch's models do not keep: they have no dropout and call
  scaled_dot_product_attention, which keeps no scores (so selective recompute, which recomputes just that
  core, saves nothing here). Under TP each rank keeps 12 of the 16 (the replicated layer-norm inputs and
  outputs stay whole) or, with sequence parallel, 1/t of all. Recompute "full" keeps only each layer's input.
  The last stage also holds the logits the loss reads (s·b·V: syntorch's head gathers the vocabulary-parallel
  logits; copied to fp32, and its log-softmax).
  Times the layer-micro-batches in flight at the schedule's peak: counted from the schedule itself (1F1B:
  pp - stage micro-batches, interleaved more, GPipe all of them), each chunk's layers per step.
"""
import torch

from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.parallel import pipeline as pp_
from syntorch.parallel.tensor import padded_vocab, plan_for, take_shard

GB = 1e9


def stage_parameters(config: ModelConfig, plan, stage: pp_.Stage) -> int:
    """Elements of the parameters one rank of `stage` holds (tied weights once), TP shards as apply_tp cuts them."""
    model = pp_.split_stage(pp_.build_stage_model(config, stage, "meta"), stage)
    styles = plan_for(model, plan.sp) if plan.tp > 1 else {}
    vocab = padded_vocab(config.vocab_size, plan.tp)
    total = 0
    for name, p in model.named_parameters():
        module, _, param = name.rpartition(".")
        style = styles.get(module, "replicated")
        total += take_shard(style, param, p, 0, plan.tp, vocab, config.d_head, config.kv_heads).numel() if plan.tp > 1 else p.numel()
    return total


def peak_in_flight(plan, stage: int) -> int:
    """The most chunk-micro-batches whose activations a stage holds at once in its schedule."""
    alive = peak = 0
    for kind, _, _ in pp_.schedule(plan.schedule, stage, plan.pp, plan.microbatches, plan.virtual_stages):
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak


def layer_activation_bytes(config: ModelConfig, plan, element: int) -> float:
    """What one layer keeps for backward, per micro-batch, on one rank (see the module docstring)."""
    s, b, h, t = plan.seq, plan.micro_batch_size, config.d_model, plan.tp
    if getattr(plan, "recompute", "none") == "full":  # the layer's input only
        return element * s * b * h / (t if plan.sp else 1)
    replicated = 4 * element * s * b * h  # the two layer norms' inputs and outputs
    sharded = element * s * b * (4 * h + 2 * config.d_ff)  # Q, K, V, attention output; the MLP's two 4h tensors
    return (replicated + sharded) / t if plan.sp else replicated + sharded / t


def estimate(config: ModelConfig, plan, dtype: torch.dtype, stage_index: int) -> dict:
    """Bytes one rank of stage `stage_index` holds at its peak, by kind, and their total."""
    stage = plan.stage(config, stage_index)
    element = torch.empty((), dtype=dtype).element_size()
    n = stage_parameters(config, plan, stage)
    if plan.mode == "infer":  # forwards without gradients: nothing kept for a backward
        return {"weights": n * element, "gradients": 0, "optimizer": 0, "activations": 0, "total": n * element}
    shard = n / plan.dp if plan.zero else 0  # what ZeRO's optimizer updates (padding left out)
    layers_per_step = len(stage.layers) / stage.virtual
    activations = peak_in_flight(plan, stage_index) * layers_per_step * layer_activation_bytes(config, plan, element)
    if stage.last:  # the logits, gathered to the whole vocabulary, their fp32 copy and its log-softmax
        activations += plan.seq * plan.micro_batch_size * padded_vocab(config.vocab_size, plan.tp) * (element + 8)
    mixed = dtype != torch.float32  # FP32 masters beside AdamW's FP32 moments (parallel/precision.py)
    updated = shard or n
    optimizer = updated * (12 if mixed else 2 * element) + shard * element
    out = {"weights": n * element, "gradients": n * element + shard * element,
           "optimizer": optimizer, "activations": activations}
    return {k: int(v) for k, v in out.items()} | {"total": int(sum(out.values()))}


def check_fits(estimates: list[dict], memory_gb: float, hw_name: str) -> None:
    """A stage whose estimate exceeds the device: one line naming it and what to change."""
    for stage, est in enumerate(estimates):
        if est["total"] > memory_gb * GB:
            worst = max(("weights", "gradients", "optimizer", "activations"), key=lambda k: est[k])
            raise UserError(f"stage {stage} needs an estimated {est['total'] / GB:.1f} GB per rank but {hw_name} has "
                            f"{memory_gb:g} GB ({worst} {est[worst] / GB:.1f} GB); raise --tp/--pp, use --zero, "
                            f"or lower --micro_batch_size/--seq")
