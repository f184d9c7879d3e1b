"""The layouts `syntorch plan` searches, and the rules that prune those that cannot run.

A layout is a TrainPlan over the cluster: TP x CP x PP x DP = GPUs (DP derived), EP and the experts' own TP
(ETP) carved out of each stage's TP x CP x DP ranks (MoE models, Megatron-Core's expert rank generator), virtual stages, the layer split, ZeRO stage, SP, recomputation and the micro-batch size (the count
follows from the global batch). Each dimension takes the user's list (`--tp 8`, `--pp 4,8,16`) or its default:

- TP: the divisors of the GPUs per node (TP stays inside a node's NVLink, as Megatron advises);
- PP: the divisors of the GPUs up to the layer count; virtual stages 1-4 (Narayanan et al. 2021 ran 2-3);
- CP: 1, and powers of two while each rank keeps at least 4,096 tokens of the sequence (Llama 3 used CP
  only for its 128K context; below that the K/V all-gather is not hidden behind attention);
- EP: the divisors of the experts (MoE models only);
- ETP: 1 and TP (MoE models only): Megatron-Core's default (ETP = TP) and what DeepSeek-V3, Mixtral and Qwen3-MoE
  recipes run (ETP 1, whole experts: no TP collective inside an expert);
- ZeRO: 0 (DDP), 1 (Megatron-Core's distributed optimizer) and 3 (FSDP), Megatron-Core's three options;
  a ZeRO stage needs DP x CP > 1, else the layout is not enumerated. FSDP only without a pipeline unless
  --zero is given: it gathers every layer and reduce-scatters its gradients for each micro-batch (fsdp.py,
  as FSDP2 does), m times the traffic of ZeRO-1, which is what pipelined runs use (Megatron-Core, Llama 3);
- SP on whenever TP > 1 (Korthikanti et al. 2022: no more communication than TP alone, activations / t);
- recomputation none, selective and full; micro-batch sizes 1, 2, 4, 8, 16.
The layer split is Megatron-Core's: even when pp x vp divides the layers, else the embedding and the loss
counted as layers (--account_for_embedding/--account_for_loss), else fewer layers on the first and last
stages (--first_stage_layers/--last_stage_layers); the first that splits evenly is taken.

Rules are applied in RULES' order; each layout is counted under the first rule that prunes it, so the
counts add up to the layouts enumerated.
"""
import dataclasses
import functools
import itertools
from dataclasses import dataclass

import torch

from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.parallel import memory
from syntorch.parallel import pipeline as pp_
from syntorch.parallel.mesh import Mesh
from syntorch.parallel.plans import TrainPlan
from syntorch.parallel.tensor import check_tp

DIMS = ("tp", "pp", "cp", "ep", "etp", "virtual_stages", "micro_batch_size", "zero", "sp", "recompute")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Work:
    gpus: int
    global_batch: int  # sequences per step
    seq: int
    gpus_per_node: int = 8


@dataclass(frozen=True)
class Choices:
    """The user's values per dimension (None: the default, see the module docstring); `dp` filters the
    derived DP degree."""
    tp: tuple | None = None
    pp: tuple | None = None
    cp: tuple | None = None
    ep: tuple | None = None
    etp: tuple | None = None  # values; None in a tuple stands for TP
    dp: tuple | None = None
    virtual_stages: tuple | None = None
    micro_batch_size: tuple | None = None
    zero: tuple | None = None
    sp: tuple | None = None
    recompute: tuple | None = None


def divisors(n: int, most: int | None = None) -> tuple:
    return tuple(d for d in range(1, min(n, most or n) + 1) if n % d == 0)


def candidates(config: ModelConfig, work: Work, choices: Choices) -> dict[str, tuple]:
    """Every dimension's values: the user's, else the default."""
    cp, cps = 1, [1]
    while work.seq // (2 * cp) >= 4096:
        cp *= 2
        cps.append(cp)
    default = {"tp": divisors(work.gpus_per_node), "pp": divisors(work.gpus, config.n_layer), "cp": tuple(cps),
               "ep": divisors(config.n_experts) if config.n_experts else (1,),
               "etp": (1, None) if config.n_experts else (None,), "virtual_stages": (1, 2, 3, 4),
               "micro_batch_size": (1, 2, 4, 8, 16), "zero": (0, 1, 3), "sp": (True,), "recompute": RECOMPUTE}
    return {d: getattr(choices, d) or default[d] for d in DIMS}


def applicable(v: dict, gpus: int) -> bool:
    """Combinations that mean nothing are not layouts at all (not counted as pruned): SP without TP,
    virtual stages without a pipeline, ZeRO with a single data-parallel rank (DP x CP) to shard over."""
    model_ranks = v["tp"] * v["pp"] * v["cp"]
    lone = gpus % model_ranks == 0 and gpus // model_ranks * v["cp"] == 1
    return not (v["sp"] and v["tp"] == 1) and not (v["virtual_stages"] > 1 and v["pp"] == 1) and not (v["zero"] and lone)


@functools.cache
def layer_split(n_layer: int, pp: int, virtual: int) -> dict | None:
    """TrainPlan's layout fields of the first of Megatron-Core's splits that works (module docstring)."""
    splits = [{}, dict(account_for_embedding=True, account_for_loss=True), dict(account_for_embedding=True),
              dict(account_for_loss=True)]
    per = -(-n_layer // pp)  # the middle stages' count; the ends share what is left
    rest = n_layer - (pp - 2) * per
    if pp > 2 and rest >= 2:
        splits.append(dict(first_stage_layers=rest // 2, last_stage_layers=rest - rest // 2))
    for split in splits:
        if not split and n_layer % (pp * virtual):
            continue  # pipeline.stage_chunks would split unevenly, which Megatron-Core does not
        try:
            pp_.stage_chunks(n_layer, pp, virtual, TrainPlan(pp=pp, **split).layout)
        except UserError:
            continue
        return split
    return None


def layers_text(config: ModelConfig, plan: TrainPlan) -> str:
    """Layers per stage: "12", or "7/8/7" (first/middle/last) for an uneven split."""
    counts = [len(plan.stage(config, s).layers) for s in (0, min(1, plan.pp - 1), plan.pp - 1)]
    return str(counts[0]) if len(set(counts)) == 1 else "/".join(map(str, counts))


# the rules, in the order they are applied (space.first_rule, then memory and recomputation), and what to change
# when one pruned the last layouts
RULES = {
    "gpus": "tp x pp x cp divides the GPUs",
    "tp": "tp divides the heads and FFN",
    "layers": "pp x virtual stages split the layers",
    "batch": "dp x micro-batch size divides the global batch",
    "interleave": "interleaving needs micro-batches a multiple of pp",
    "sequence": "cp (and tp with SP) divide the sequence",
    "ep": "ep divides the experts, and etp x ep nests in each stage's tp x cp x dp ranks",
    "dp": "the --dp given",
    "fsdp": "FSDP only without a pipeline (the default --zero)",
    "refused": "TrainPlan's own checks",
    "memory": "memory estimate within the device",
    "recompute": "no less recomputation fits (recomputing more is never faster)",
}
ADVICE = {
    "gpus": "give --gpus a multiple of the TP/PP/CP degrees",
    "tp": "give --tp values that divide the heads",
    "layers": "give --pp values that divide the layers, or --virtual_stages 1",
    "batch": "change --global_batch (or --tokens_per_step) to a multiple of the DP degrees",
    "interleave": "allow --virtual_stages 1 or a batch with more micro-batches",
    "sequence": "give --cp (and --tp) values that divide --seq",
    "ep": "give --ep (and --etp) values that divide the experts and tp x cp x dp",
    "dp": "widen --dp",
    "fsdp": "give --zero 3 to allow FSDP with a pipeline",
    "refused": "relax the constraints",
    "memory": "raise --gpus or --max_memory_gb, allow --recompute full, ZeRO (--zero 1,3) or more --tp/--pp",
    "recompute": "",
}


def first_rule(config: ModelConfig, work: Work, choices: Choices, v: dict) -> str | None:
    """The first rule that prunes the layout `v` (dimension values), short of memory, or None."""
    tp, pp, cp, ep, vp, mbs = v["tp"], v["pp"], v["cp"], v["ep"], v["virtual_stages"], v["micro_batch_size"]
    if work.gpus % (tp * pp * cp):
        return "gpus"
    dp = work.gpus // (tp * pp * cp)
    checks = [("tp", lambda: check_tp(config, tp)),
              ("layers", lambda: layer_split(config.n_layer, pp, vp) is not None),
              ("batch", lambda: work.global_batch % (dp * mbs) == 0),
              ("interleave", lambda: vp == 1 or (work.global_batch // (dp * mbs)) % pp == 0),
              ("sequence", lambda: work.seq % (2 * cp) == 0 if cp > 1 else True),
              ("sequence", lambda: not v["sp"] or (work.seq // cp) % tp == 0),
              ("ep", lambda: (ep == 1 or config.n_experts % ep == 0) and expert_split(v, dp)),
              ("dp", lambda: not choices.dp or dp in choices.dp),
              ("fsdp", lambda: bool(choices.zero) or v["zero"] != 3 or pp == 1)]
    for rule, check in checks:
        try:
            if check() is False:
                return rule
        except UserError:
            return rule
    return None


def expert_split(v: dict, dp: int) -> bool:
    """The mesh's own check: etp x ep divides a stage's tp x cp x dp ranks, the two factorings nesting."""
    etp = v["tp"] if v["etp"] is None else v["etp"]
    Mesh(dp=dp, tp=v["tp"], cp=v["cp"], ep=v["ep"], etp=etp)
    return True


def layouts(config: ModelConfig, work: Work, choices: Choices, pruned: dict, fp8: bool = False) -> list[TrainPlan]:
    """Every applicable layout that passes the rules short of memory, as TrainPlans in a fixed order;
    `pruned[rule]` counts the others."""
    values = candidates(config, work, choices)
    plans, seen = [], set()
    for combo in itertools.product(*(values[d] for d in DIMS)):
        v = dict(zip(DIMS, combo))
        if not applicable(v, work.gpus):
            continue
        rule = first_rule(config, work, choices, v)
        plan = None
        if rule is None:
            try:
                plan = make_plan(config, work, v, fp8)
            except UserError:
                rule = "refused"
        if rule:
            pruned[rule] = pruned.get(rule, 0) + 1
        elif plan not in seen:  # ETP 1 and "TP" are one layout at TP 1
            seen.add(plan)
            plans.append(plan)
    return plans


def make_plan(config: ModelConfig, work: Work, v: dict, fp8: bool = False) -> TrainPlan:
    dp = work.gpus // (v["tp"] * v["pp"] * v["cp"])
    split = layer_split(config.n_layer, v["pp"], v["virtual_stages"])
    plan = TrainPlan(dp=dp, microbatches=work.global_batch // (dp * v["micro_batch_size"]), seq=work.seq,
                     fp8=fp8, **v, **split)  # etp None: TP
    plan.check(config, work.gpus, work.global_batch)
    return plan


class MemoryModel:
    """memory.estimate's figures for many layouts: the stages and their parameter counts cached by what they
    depend on, and only the stages that can be the peak evaluated: the first, the second (the middle stages
    hold as many layers and parameters, and no more micro-batches in flight than it) and the last."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        self.config, self.dtype = config, dtype
        self.element = torch.empty((), dtype=dtype).element_size()
        self._params, self._stages = {}, {}

    def stage_bytes(self, plan: TrainPlan, index: int) -> int:
        """memory.estimate(config, plan, dtype, index)["total"]."""
        where = (plan.pp, plan.virtual_stages, plan.layout, index)
        if where not in self._stages:
            self._stages[where] = plan.stage(self.config, index)
        stage = self._stages[where]
        key = (plan.tp, plan.sp, plan.ep, plan.etp, tuple(stage.layers), stage.index == 0, stage.last)
        if key not in self._params:
            self._params[key] = memory.stage_params(self.config, plan, stage)
        out = memory.model_state_bytes(self._params[key], plan, self.element, mixed=self.dtype != torch.float32)
        out["activations"] = memory.activation_bytes(self.config, plan, self.element, stage)
        return int(sum(out.values()))

    def peak(self, plan: TrainPlan) -> int:
        """The most bytes any rank holds."""
        return max(self.stage_bytes(plan, s) for s in sorted({0, min(1, plan.pp - 1), plan.pp - 1}))


def least_recompute(fits: list[tuple]) -> list[tuple]:
    """Of (plan, ...) that fit, each layout with the least recomputation that fits: recomputing adds work to
    backward and nothing else (recompute.py), so the layout recomputing more is never predicted faster."""
    least = {}
    for item in fits:
        key = dataclasses.replace(item[0], recompute="none")
        if key not in least or RECOMPUTE.index(item[0].recompute) < RECOMPUTE.index(least[key][0].recompute):
            least[key] = item
    kept = {id(item) for item in least.values()}
    return [item for item in fits if id(item) in kept]
