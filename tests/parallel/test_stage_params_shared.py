"""memory.stage_params counts a stage part by part (what it holds outside its layers, and one layer of each
kind, once per rank plan), and gets what counting the whole stage model a rank holds gets: every stage of a
matrix of plans and models (tied and untied heads, dense and MoE layers, EP and ETP, TP with SP, uneven first
and last stages, interleaving, FP8, inference), each stage's model assembled whole on meta for the plan's own
representative rank (its DP and CP too), its parameters counted as fsdp.py makes its units."""
import dataclasses

import pytest
import torch
from conftest import tiny_config

from syntorch.parallel import memory
from syntorch.parallel.assemble import RankPlan, assemble_rank
from syntorch.parallel.distributed import symbolic_world
from syntorch.parallel.mesh import init_groups
from syntorch.parallel.plans import TrainPlan
from syntorch.plan.space import MemoryModel

# 16 layers: 0-4 dense, then MoE (MLA attention, shared experts)
DEEPSEEK = tiny_config("deepseek-v3", n_layer=16, n_head=4, d_head=24, rotary_dim=8, v_head_dim=12, kv_lora_rank=16,
                       q_lora_rank=24, n_experts=8, d_ff_expert=32, d_ff=64, moe_top_k=3, first_k_dense=5,
                       moe_n_group=4, moe_topk_group=2, rope_original_positions=16)
MIXTRAL = tiny_config("mixtral-8x22b", n_layer=8, n_kv_head=2, d_ff=64, n_experts=4, n_positions=64)
GPT = tiny_config("gpt2", n_layer=8, vocab_size=130)  # a tied head, a vocabulary TP pads
LLAMA = tiny_config("llama-3-8b", n_layer=10, n_kv_head=2, vocab_size=128)  # an untied head
S = dict(seq=32)
CASES = {
    "deepseek_ep": (DEEPSEEK, TrainPlan(pp=4, ep=2, dp=2, **S)),
    "deepseek_etp1_fsdp": (DEEPSEEK, TrainPlan(pp=2, tp=2, sp=True, ep=4, etp=1, dp=2, zero=3, **S)),
    "deepseek_interleaved": (DEEPSEEK, TrainPlan(pp=2, virtual_stages=2, dp=2, ep=2, microbatches=4, **S)),
    "mixtral_tp_ep": (MIXTRAL, TrainPlan(pp=2, tp=2, ep=2, dp=2, cp=2, **S)),
    "gpt_tp": (GPT, TrainPlan(pp=4, tp=2, **S)),
    "gpt_one_stage": (GPT, TrainPlan(tp=2, sp=True, dp=4, zero=1, recompute="full", **S)),
    "gpt_uneven": (GPT, TrainPlan(pp=3, first_stage_layers=2, last_stage_layers=2, recompute="selective", **S)),
    "gpt_account": (GPT, TrainPlan(pp=5, tp=2, account_for_embedding=True, account_for_loss=True, **S)),
    "gpt_fp8": (GPT, TrainPlan(pp=2, tp=2, fp8=True, **S)),
    "llama_interleaved": (LLAMA, TrainPlan(pp=2, virtual_stages=5, tp=2, sp=True, microbatches=4, **S)),
    "llama_uneven_interleaved": (LLAMA, TrainPlan(pp=3, virtual_stages=2, first_stage_layers=2, last_stage_layers=2,
                                                  microbatches=6, **S)),
    "llama_infer": (LLAMA, TrainPlan(pp=2, tp=2, mode="infer", **S)),
}


def whole_stage(config, plan: TrainPlan, stage: int) -> memory.StageParams:
    """The stage's model as its representative rank assembles it (every layer, the plan as it is)."""
    rank_plan = RankPlan(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(RankPlan)})
    with symbolic_world(plan.mesh.representative(stage), plan.mesh.world_size):
        model = assemble_rank(config, rank_plan, init_groups(plan.mesh, only_mine=True), "meta").model
    return memory._count_params(list(model.named_parameters()), plan.ep)


@pytest.mark.parametrize("name", CASES)
def test_each_stage_counts_as_its_whole_model(name):
    config, plan = CASES[name]
    memory._PARTS.clear()
    counts = [memory.stage_params(config, plan, plan.stage(config, s)) for s in range(plan.pp)]
    assert counts == [whole_stage(config, plan, s) for s in range(plan.pp)]
    assert len(memory._PARTS) == 1  # one rank plan, its parts counted once
    if config is DEEPSEEK and plan.pp == 4:
        assert counts[1] != counts[2]  # stage 1 holds a dense layer, stage 2 none


def test_the_search_memory_model_is_memory_estimate():
    """MemoryModel (its stages and counts cached across layouts) gives memory.estimate's bytes for plans
    asked one after another, sharing rank plans and not."""
    model = MemoryModel(DEEPSEEK, torch.bfloat16)
    for config, plan in (CASES[n] for n in ("deepseek_ep", "deepseek_etp1_fsdp", "deepseek_interleaved")):
        totals = [memory.estimate(config, plan, torch.bfloat16, s)["total"] for s in range(plan.pp)]
        assert [model.stage_bytes(plan, s) for s in range(plan.pp)] == totals
        assert model.peak(plan) == max(totals)
