"""Per-rank memory of a training step, estimated by the published formulas: what a rank of each pipeline
stage holds at its peak. Mixed precision with Adam unless the model dtype is FP32.

Model states (Rajbhandari et al. 2020, "ZeRO", section 3.1 and 5): Ψ is what the rank holds of the model:
its stage's layers (pipeline), their TP shards as apply_tp cuts them, its 1/ep of the experts (the rest is
replicated over EP), each expert's 1/etp shard (--etp, the experts' own TP size; expert.py), counted on the
rank's model as assemble.py builds it on meta. With mixed precision a rank keeps 2Ψ of
weights, 2Ψ of gradients and KΨ of optimizer states, K = 12 (FP32 master weights, Adam's two FP32 moments);
in FP32, 4Ψ + 4Ψ + 8Ψ. ZeRO divides over N_d, the ranks gradients are averaged over (DP x CP; for the
experts their expert-DP group, the replicas of one expert shard: TP x CP x DP / (etp x ep), mesh.py):
stage 1 the optimizer states, stage 2 the gradients too, stage 3 the weights too, 16Ψ/N_d in all. Beside that, what is briefly whole:
- ZeRO-2: one gradient bucket (--bucket_mb) before its reduce-scatter;
- ZeRO-3 (FSDP, fsdp.py): the unit being computed and the one prefetched (two of the largest unit, whole
  over DP: a layer, or the stage's embeddings and head; with EP a layer's dense part and its experts are
  two units) and one unit's whole gradients before their
  reduce-scatter. With --reshard_after_forward false (fsdp.py) every unit of the stage is whole between its
  forward and backward instead: Ψ whole beside the Ψ/N_d shards.
With --grad_reduce_dtype fp32 the gradients are counted in FP32 (4 bytes each), as Megatron-Core's
accumulate_allreduce_grads_in_fp32 keeps them (its main_grad buffers) and FSDP2 reduces them with
reduce_dtype=torch.float32: the whole (or ZeRO-sharded) gradients, the bucket and the unit's gradients.

Activations per layer and micro-batch, after Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models", section 4 and Table 2), with 2-byte activations:
    no parallelism sbh(34 + 5as/h); TP t: sbh(10 + 24/t + 5as/(ht)); TP + SP: sbh/t (34 + 5as/h);
    selective recompute drops the 5as/h term; full recompute keeps the layer input, 2sbh (2sbh/t with SP).
Korthikanti counts the tensors backward reads; they are counted here the same way from the model's shapes,
per token, for any family:
- outside the TP regions (whole on each TP rank, 1/t of the sequence with SP): the two norms' inputs and
  outputs (the outputs are the QKV and fc1 / router inputs); Korthikanti's 4 + 2 + 2 bytes of his 10;
- inside (1/t): Q and the attention output (n_head·d_head each), the MLP's intermediates: GeLU's input and
  output (2·d_ff, his 16 bytes), or for SwiGLU the fc1 output [gate; up] and fc2's input (3·d_ff: Megatron-
  Core's fused bias-SwiGLU keeps only its input and recomputes the rest; syntorch's eager model keeps the
  SiLU output too); K and V (2·kv_heads·d_head, a K/V head replicated when t exceeds them: GQA);
- Multi-head Latent Attention (DeepSeek): Q and K of d_head, V and the output of v_head_dim per head; outside,
  the latents (q_a's output and its norm's, kv_a's latent and rotary key, the latent's norm);
- a mixture of experts (Mixtral): each token's k routed copies into and out of the experts (2·k·h, counted
  like the norms; with --etp below --tp each of the tp / etp ranks sharing the tokens routes 1/(tp / etp)
  of them, expert.py) and k experts' intermediates (k x the above with expert_d_ff, over etp shards of the
  rank's 1/(tp / etp) of the tokens: 1/t either way), uniform load.
Conventions, and why: flash attention, which the kernels run (and scaled_dot_product_attention, which
syntorch's models call), keeps no a·s² score matrix, so the 5as/h term is never counted and selective
recompute changes nothing here (its log-sum-exp statistics, a·s·b FP32, are left out: < 1% of the rest).
syntorch's models have no dropout, so Korthikanti's dropout masks (2sbh bytes of his 34, plus 1 of his 5as/h)
are left out: for GPT this is his selective-recompute row less 2sbh (2sbh/t with SP).
Context parallelism (context.py) gives each rank s/cp of every sequence, so every term is divided by cp,
except K and V, which attention gathers whole over the CP group and keeps for backward.
Full recompute keeps each layer's input, and while a layer is recomputed in backward its full activations
once more. The last stage also holds the logits its loss reads: under TP the vocabulary-parallel loss keeps
each rank's V/t shard and its FP32 softmax for backward (parallel/loss.py); without TP, torch's loss keeps
the logits' FP32 copy and their log-softmax.
How many layer-micro-batches a stage holds is counted from the schedule itself: 1F1B's first stage holds
min(p, m) micro-batches; interleaved, p·v + p - 1 chunk-micro-batches, i.e. L(1 + (p-1)/(p·v)) layers'
worth (Narayanan et al. 2021's schedule, section 2.2.2; the factor as Korthikanti et al. 2022, section
4.2.3, give it); GPipe all m. Chunks of uneven size (layout.py) count their own layers at the peak.
"""
import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.parallel import pipeline as pp_
from syntorch.parallel.assemble import RankPlan, assemble_rank
from syntorch.parallel.distributed import symbolic_world
from syntorch.parallel.expert import is_expert_param
from syntorch.parallel.mesh import init_groups
from syntorch.parallel.tensor import padded_vocab

GB = 1e9


@dataclass(frozen=True)
class StageParams:
    """Elements of the parameters one rank of a stage holds: dense (replicated over EP), its 1/ep of the
    experts (each 1/etp), and its largest FSDP unit (a layer, its experts with EP, or the rest), whole."""
    dense: int
    experts: int
    largest_unit: int


# (the config's fields, the rank plan) -> its _Parts: a search asks thousands of stages of a few rank plans
_PARTS: dict[tuple, "_Parts"] = {}


def stage_params(config: ModelConfig, plan, stage: pp_.Stage) -> StageParams:
    """Counted on the model a rank of `stage` holds, as assemble_rank builds it on meta (every rank of a stage
    holds as many: equal TP and ETP shards, 1/ep of the experts), tied weights once: part by part (_Parts),
    what the stage holds outside its layers and each of its layers, counted once per rank plan."""
    assert stage == plan.stage(config, stage.index), f"{stage} is not one of the plan's stages"
    small = _rank_plan(plan)
    key = (repr(config), small)
    if key not in _PARTS:
        _PARTS[key] = _Parts(config, small)
    ends = _PARTS[key].ends(stage.first, stage.last)
    layers = [_PARTS[key].layer(_moe_layer(config, i)) for i in stage.layers]
    return StageParams(ends.dense + sum(p.dense for p in layers), ends.experts + sum(p.experts for p in layers),
                       max(p.largest_unit for p in [ends, *layers]))


def _moe_layer(config: ModelConfig, layer: int) -> bool:
    return bool(config.n_experts) and layer >= config.first_k_dense


class _Parts:
    """One rank plan's parameters by part of a stage: outside its layers (the embeddings on the first stage,
    the final norm and head on the last: pipeline.split_stage), by whether the stage is first and last, and
    one layer, by its kind (a layer's parameters differ from another's only by its MLP, dense or experts:
    models/gpt.py's Block). Each counted on a stage model of one layer (pipeline.build_stage_model builds only
    the layers asked), assembled as assemble_rank assembles every stage: ~10 ms, where a whole stage of a
    405B model cost ~0.1 s and a search asked ~230 of them."""

    # (first, last) -> the pipeline depth and stage that is so
    STAGES = {(True, True): (1, 0), (True, False): (2, 0), (False, True): (2, 1), (False, False): (3, 1)}

    def __init__(self, config: ModelConfig, small: RankPlan):
        self.config, self.small = config, small
        self._ends: dict[tuple, StageParams] = {}
        self._layers: dict[bool, StageParams] = {}  # (largest_unit: the layer's own largest unit)

    def ends(self, first: bool, last: bool) -> StageParams:
        if (first, last) not in self._ends:
            self._count(first, last)
        return self._ends[first, last]

    def layer(self, moe: bool) -> StageParams:
        if moe not in self._layers:
            self._count(True, True, next(i for i in range(self.config.n_layer) if _moe_layer(self.config, i) == moe))
        return self._layers[moe]

    def _count(self, first: bool, last: bool, layer: int | None = None) -> None:
        """Counts the stage that is `first`/`last` with one of its layers (`layer`, else its first) built."""
        pp, index = self.STAGES[first, last]
        plan = dataclasses.replace(self.small, pp=pp)
        stage = plan.stage(self.config, index)
        layer = stage.layers[0] if layer is None else layer
        model = _rank_model(self.config, plan, dataclasses.replace(stage, layers=(layer,), chunks=()))
        named = list(model.named_parameters())
        self._ends[first, last] = _count_params([(n, p) for n, p in named if not n.startswith("layers.")], plan.ep)
        self._layers.setdefault(_moe_layer(self.config, layer),
                                _count_params([(n, p) for n, p in named if n.startswith("layers.")], plan.ep))


def _count_params(named: list[tuple[str, nn.Parameter]], ep: int) -> StageParams:
    dense = experts = 0
    units: dict[str, int] = {}
    for name, p in named:
        expert = is_expert_param(name)
        if expert:
            experts += p.numel()
        else:
            dense += p.numel()
        unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "rest"  # fsdp.py's units
        unit += ".experts" if expert and ep > 1 else ""
        units[unit] = units.get(unit, 0) + p.numel()
    return StageParams(dense, experts, max(units.values(), default=0))


def _rank_plan(plan) -> RankPlan:
    """The smallest plan whose ranks' layers and ends (_Parts) hold as much as `plan`'s: parameters do not
    depend on DP or CP, so neither is kept but for the DP replicas EP is carved out of (mesh.py), nor on the
    pipeline's depth or split, which _Parts sets, nor on recomputation (it wraps forwards only)."""
    dp = plan.ep // math.gcd(plan.ep, plan.tp // plan.etp)
    return RankPlan(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(RankPlan)}
                    | dict(dp=dp, cp=1, pp=1, virtual_stages=1, first_stage_layers=None, last_stage_layers=None,
                           account_for_embedding=False, account_for_loss=False, recompute="none"))


def _rank_model(config: ModelConfig, small: RankPlan, stage: pp_.Stage) -> nn.Module:
    """The model of `stage`'s representative rank of `small` (_rank_plan), assembled on meta against the fake
    backend, with the layers `stage` names (those of small's stage `stage.index`, or some of them)."""
    rank = small.mesh.representative(stage.index)
    with symbolic_world(rank, small.mesh.world_size):
        model = pp_.build_stage_model(config, stage, "meta")
        return assemble_rank(config, small, init_groups(small.mesh, only_mine=True), "meta", model=model).model


def stage_parameters(config: ModelConfig, plan, stage: pp_.Stage) -> int:
    """Ψ: elements of the parameters one rank of `stage` holds (TP shards, 1/ep of the experts)."""
    params = stage_params(config, plan, stage)
    return params.dense + params.experts


def peak_in_flight(plan, stage: int, chunk: int | None = None, weights: list[int] | None = None) -> int:
    """The most chunk-micro-batches whose activations a stage holds at once in its schedule (of one chunk
    when given); with `weights`, each chunk's counted by its weight (its layers: uneven chunks, layout.py)."""
    return _peak_in_flight(plan.schedule, stage, plan.pp, plan.microbatches, plan.virtual_stages, chunk,
                           tuple(weights) if weights else None)


@functools.cache  # a search asks it of thousands of layouts, most sharing their schedule with others
def _peak_in_flight(schedule: str, stage: int, pp: int, microbatches: int, virtual: int, chunk: int | None,
                    weights: tuple | None) -> int:
    alive = peak = 0
    for kind, _, c in pp_.schedule(schedule, stage, pp, microbatches, virtual):
        if chunk is None or c == chunk:
            alive += (weights[c] if weights else 1) * (1 if kind == "F" else -1)
            peak = max(peak, alive)
    return peak


def model_state_bytes(params: StageParams, plan, element: int, mixed: bool) -> dict:
    """Weights, gradients and optimizer states of one rank, ZeRO's stages as Rajbhandari et al. 2020 count
    them, plus what ZeRO-2/3 hold whole for a moment (module docstring)."""
    whole = params.dense + params.experts  # Ψ
    # Ψ / N_d: the dense parameters over the grad group, the experts over their replicas (expert-DP)
    sharded = params.dense / plan.grad_ranks + params.experts / plan.expert_dp
    k = 12 if mixed else 2 * element  # Adam: FP32 masters and two FP32 moments, or the moments alone
    grad_element = 4 if plan.grad_reduce_dtype == "fp32" else element
    weights = element * (sharded if plan.zero == 3 else whole)
    gradients = grad_element * (sharded if plan.zero >= 2 else whole)
    if plan.zero == 2:  # one bucket of whole gradients before its reduce-scatter
        gradients += min(plan.bucket_mb * 2**20, grad_element * whole)
    if plan.zero == 3:  # the unit computed and the one prefetched (or, not resharded, all), one unit's gradients
        weights += element * (2 * params.largest_unit if plan.reshard_after_forward else whole)
        gradients += grad_element * params.largest_unit
    return {"weights": weights, "gradients": gradients, "optimizer": k * (sharded if plan.zero else whole)}


def token_activations(config: ModelConfig, plan) -> tuple[float, float]:
    """Elements one layer keeps for backward per token on one rank: (of the rank's own tokens, s/cp of each
    sequence; of the whole sequence: K and V as attention reads them). See the module docstring."""
    h, t = config.d_model, plan.tp
    intermediates = (3 if config.gated_mlp else 2)  # per d_ff: SwiGLU's [gate; up] and fc2 input, or GeLU's
    outside = 4 * h  # the norms' inputs and outputs
    inside = 2 * config.n_head * config.d_head  # Q and the attention output
    if config.n_experts:
        outside += 2 * config.moe_top_k * h * plan.etp / t  # the routed copies into and out of the experts
        inside += intermediates * (config.moe_top_k + config.n_shared_experts) * config.expert_d_ff
    else:
        inside += intermediates * config.d_ff
    kv = 2 * max(config.kv_heads, t) * config.d_head / t  # replicated K/V heads when t exceeds them
    if config.mla:  # per head Q, K (d_head) and V, the output (v_head_dim); the latents, whole on every TP rank
        qkv = config.n_head * (config.d_head + config.value_head_dim)
        inside += qkv - 2 * config.n_head * config.d_head
        outside += 2 * config.q_lora_rank + 2 * config.kv_lora_rank + config.rotary_dim
        kv = qkv / t
    return outside / (t if plan.sp else 1) + inside / t, kv


def layer_activation_bytes(config: ModelConfig, plan, element: int) -> float:
    """What one layer keeps for backward, per micro-batch, on one rank (see the module docstring)."""
    if plan.recompute == "full":  # the layer's input only
        return element * (plan.seq // plan.cp) * plan.micro_batch_size * config.d_model / (plan.tp if plan.sp else 1)
    return whole_layer_bytes(config, plan, element)


def whole_layer_bytes(config: ModelConfig, plan, element: int) -> float:
    """Everything one layer's backward reads, per micro-batch, on one rank: what it keeps without full
    recompute (flash attention: selective recompute keeps the same)."""
    own, whole = token_activations(config, plan)
    return element * plan.micro_batch_size * (plan.seq // plan.cp * own + plan.seq * whole)


def activation_bytes(config: ModelConfig, plan, element: int, stage: pp_.Stage) -> float:
    """The stage's activations at the peak of its schedule: layers x micro-batches in flight, the layer
    being recomputed under full recompute, and the last stage's logits."""
    layers = [len(chunk) for chunk in stage.chunks or (stage.layers,)]
    total = peak_in_flight(plan, stage.index, weights=layers) * layer_activation_bytes(config, plan, element)
    if plan.recompute == "full":  # one layer's activations, while backward recomputes it
        total += whole_layer_bytes(config, plan, element)
    if stage.last:  # per micro-batch whose loss awaits its backward (module docstring)
        logits = plan.seq // plan.cp * plan.micro_batch_size * padded_vocab(config.vocab_size, plan.tp) // plan.tp
        total += peak_in_flight(plan, stage.index, stage.virtual - 1) * logits * (element + (4 if plan.tp > 1 else 8))
    return total


def estimate(config: ModelConfig, plan, dtype: torch.dtype, stage_index: int) -> dict:
    """Bytes one rank of stage `stage_index` holds at its peak, by kind, and their total."""
    stage = plan.stage(config, stage_index)
    element = torch.empty((), dtype=dtype).element_size()
    params = stage_params(config, plan, stage)
    if plan.mode == "infer":  # forwards without gradients: nothing kept for a backward
        weights = (params.dense + params.experts) * element
        return {"weights": weights, "gradients": 0, "optimizer": 0, "activations": 0, "total": weights}
    out = model_state_bytes(params, plan, element, mixed=dtype != torch.float32)
    out["activations"] = activation_bytes(config, plan, element, stage)
    return {k: int(v) for k, v in out.items()} | {"total": int(sum(out.values()))}


ZERO_SHARDING = {"optimizer": 1, "gradients": 2, "weights": 3}  # the ZeRO stage that first shards each


def check_fits(estimates: list[dict], memory_gb: float, hw_name: str, zero: int = 0) -> None:
    """A stage whose estimate exceeds the device: one line naming it, its largest part and what to change
    (`zero`: the plan's ZeRO stage, so the advice does not ask for sharding the plan already does)."""
    for stage, est in enumerate(estimates):
        if est["total"] > memory_gb * GB:
            worst = max(("weights", "gradients", "optimizer", "activations"), key=lambda k: est[k])
            shard = ("raise --dp (the shards shrink with it)" if zero >= ZERO_SHARDING.get(worst, 4)
                     else f"shard the {worst} with --zero {ZERO_SHARDING.get(worst)} or above")
            advice = ("use --recompute full, --sp or --cp, or lower --micro_batch_size/--seq" if worst == "activations"
                      else f"raise --tp/--pp (or --ep), or {shard}")
            raise UserError(f"stage {stage} needs an estimated {est['total'] / GB:.1f} GB per rank but {hw_name} has "
                            f"{memory_gb:g} GB ({worst} {est[worst] / GB:.1f} GB); {advice}")
