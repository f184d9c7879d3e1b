"""One rank's model, assembled in one order: training (plans.apply_plans), inference (inference/spec.py, a
checkpoint's per-rank loading in shard_files.py), tracing (trace/generation.py, trace/training.py) and the memory
estimate (memory.py) all get their rank's model from `assemble_rank`, so they hold the same model.

    plan = RankPlan(tp=2, pp=2, mode="infer")  # TrainPlan is a RankPlan with the training step's options
    rank = assemble_rank(config, plan, groups, device="meta")

The order, and why (torchtitan's parallelize_llama composes TP, then the rest, the same way):
1. Build what the stage holds (on meta only its layers; elsewhere the whole model, drawn as one process draws
   it, so every rank's weights are the single-process ones; on meta when the weights come from a checkpoint).
2. EP keeps each MoE layer's share of the experts (expert.py) before TP, so TP's region around each MoE layer
   wraps the layer that runs: EP once replaced the MoE module after TP and lost TP's all-reduce.
3. TP (+SP) while the model still holds both ends: the vocab-parallel head is tied to the vocab-parallel
   embedding while both exist, so the last stage's copy of a tied embedding is sharded alike. With --etp other
   than --tp the experts are set aside while TP runs and sharded over their own expert-TP ranks after.
4. The stage cut drops what the stage does not own (pipeline.split_stage) and adds the loss on the last stage
   (training, or a pipeline's last stage).
5. Weights from a checkpoint, into the sharded, cut model: each rank reads only its own tensors.
6. FP8 GEMMs (fp8.py), on the weights the rank holds. (Int8 quantization is inference's, applied after this
   by inference/spec.run_model: quant.py imports parallel/tensor.py, so this package cannot import it back.)
7. Recomputation (recompute.py) wraps what the stage kept; it changes what backward runs, not the parameters.
8. CP (context.py): every attention reads K/V gathered across the CP group.
The training state (gradient sync, ZeRO/FSDP, the optimizer) goes on top in plans.apply_plans.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from syntorch.config import ModelConfig
from syntorch.parallel import pipeline as pp_
from syntorch.parallel.clip import tp_replicated
from syntorch.parallel.context import apply_cp
from syntorch.parallel.expert import apply_ep, experts_aside, shard_experts
from syntorch.parallel.fp8 import apply_fp8
from syntorch.parallel.layout import Layout
from syntorch.parallel.mesh import Mesh, MeshGroups
from syntorch.parallel.moe_load import set_load
from syntorch.parallel.recompute import apply_recompute
from syntorch.parallel.tensor import TPPlan, apply_tp, check_sp

# fills the cut, sharded model on meta with this rank's tensors: (model, tp_plan, stage) -> None
Weights = Callable[[nn.Module, TPPlan | None, pp_.Stage], None]


@dataclass(frozen=True)
class RankPlan:
    """What shapes one rank's model: the parallelisms that cut or wrap it and what its GEMMs run in."""
    tp: int = 1
    pp: int = 1
    dp: int = 1  # replicas of the model (training: gradients averaged over them); EP is carved out of them
    ep: int = 1  # expert parallel: carved out of a stage's TP x CP x DP ranks after etp (mesh.py)
    etp: int | None = None  # the experts' own TP size (Megatron-Core's --expert-tensor-parallel-size); None: tp
    sp: bool = False
    cp: int = 1  # context parallel: each sequence split over cp ranks (context.py)
    virtual_stages: int = 1  # interleaved 1F1B: each stage holds this many non-contiguous chunks of layers
    # uneven pipeline stages, Megatron-Core's options (layout.py): layers on the first / last stage, or the
    # embedding / loss counted as a layer in the split
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    account_for_embedding: bool = False
    account_for_loss: bool = False
    mode: str = "train"  # "infer": forwards only
    recompute: str = "none"  # activation recomputation in backward: "none" | "selective" | "full"
    fp8: bool = False  # Linear GEMMs in FP8 as Transformer Engine runs them (fp8.py); the model dtype stays bf16
    # FP8 weights cast once when assembled, as an FP8 inference engine loads them (`syntorch infer --dtype fp8`);
    # else each step casts them (training, and a training plan's --mode infer)
    fp8_cast_once: bool = False
    # symbolic runs' routing load (moe_load.py): per MoE layer, each expert's share of the routed tokens; None:
    # uniform. Real runs route by the router's values
    moe_load: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        self.mesh  # checks the degrees are positive, and that the expert groups nest in the stage's ranks
        check_sp(self.sp, self.tp)

    @property
    def mesh(self) -> Mesh:
        return Mesh(dp=self.dp, pp=self.pp, tp=self.tp, cp=self.cp, ep=self.ep, ring=self.virtual_stages > 1,
                    etp=self.etp)

    @property
    def layout(self) -> Layout:
        return Layout(self.first_stage_layers, self.last_stage_layers, self.account_for_embedding,
                      self.account_for_loss)

    def stage(self, config: ModelConfig, index: int) -> pp_.Stage:
        chunks = pp_.stage_chunks(config.n_layer, self.pp, self.virtual_stages, self.layout)[index]
        if len(chunks) == 1:
            return pp_.Stage(index, self.pp, chunks[0])
        return pp_.Stage(index, self.pp, tuple(i for chunk in chunks for i in chunk), chunks)


@dataclass
class RankModel:
    """A rank's assembled model and what its assembly decided."""
    model: nn.Module
    stage: pp_.Stage
    tp_plan: TPPlan | None = None  # styles and local shapes, when TP applied
    tp_replicated: frozenset = frozenset()  # ids of the parameters every TP rank holds whole (clip.py)


def assemble_rank(config: ModelConfig, plan: RankPlan, groups: MeshGroups, device="meta", dtype=torch.float32,
                  model: nn.Module | None = None, weights: Weights | None = None) -> RankModel:
    """This rank's model of `config` under `plan`, in the module docstring's order. `model`: the whole model
    already built on `device` in `dtype` (`syntorch train` loads a checkpoint's weights) instead of a fresh
    one; `weights`: fills the model, built on meta, with this rank's tensors once it is cut."""
    stage = plan.stage(config, groups.stage)
    if model is None:
        model = pp_.build_stage_model(config, stage, "meta" if weights else device, dtype)
    set_load(model, plan.moe_load)
    if plan.ep > 1:
        apply_ep(model, groups.ep, plan.tp // plan.etp, groups.tp_rank // plan.etp)
    with experts_aside(model, plan.etp != plan.tp):
        tp_plan = apply_tp(model, groups.tp, plan.sp) if plan.tp > 1 else None
        replicated = tp_replicated(model, tp_plan.styles) if tp_plan else frozenset()  # before wrappers rename
    if plan.etp != plan.tp:
        shard_experts(model, plan.etp, plan.mesh.index(groups.rank, "etp"))
    if plan.mode == "train" or stage.count > 1:  # a single-stage inference model has no loss to add
        pp_.split_stage(model, stage)
    if weights:
        weights(model, tp_plan, stage)
    if plan.fp8:
        apply_fp8(model, cast_weights=plan.fp8_cast_once)
    apply_recompute(model, plan.recompute)
    if plan.cp > 1:
        apply_cp(model, groups.cp)
    model.train(plan.mode == "train")
    return RankModel(model, stage, tp_plan, replicated)
