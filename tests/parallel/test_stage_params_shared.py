"""memory.stage_params shares one count between stages of one shape (the same MLPs, the embedding and head
alike): each stage's count equals the one made on its own rank model, and stages whose layers differ in
their MLPs (dense or experts) get their own."""
import pytest

from conftest import tiny_config
from syntorch.parallel import memory
from syntorch.parallel.plans import TrainPlan

# 16 layers over 4 stages: layers 0-4 dense, then MoE: stage 1 holds one dense layer, stage 2 none
MOE = tiny_config("deepseek-v3", n_layer=16, n_head=4, d_head=24, rotary_dim=8, v_head_dim=12, kv_lora_rank=16,
                  q_lora_rank=24, n_experts=8, d_ff_expert=32, d_ff=64, moe_top_k=3, first_k_dense=5,
                  moe_n_group=4, moe_topk_group=2, rope_original_positions=16)
GPT = tiny_config("gpt2", n_layer=8, vocab_size=128)


@pytest.mark.parametrize("config, plan", [(MOE, TrainPlan(pp=4, ep=2, dp=2, seq=32)),
                                          (GPT, TrainPlan(pp=4, tp=2, seq=32))])
def test_each_stage_counts_as_its_own_model(config, plan):
    memory._PARAMS.clear()
    counts = [memory.stage_params(config, plan, plan.stage(config, s)) for s in range(plan.pp)]
    own = [memory._count_params(memory._rank_model(config, memory._rank_plan(plan), s), plan.ep)
           for s in range(plan.pp)]
    assert counts == own
    assert len(memory._PARAMS) == (4 if config is MOE else 3)  # GPT's middle stages share one count
    if config is MOE:
        assert counts[1] != counts[2]
