"""What a prediction reuses rather than finds again gives the step costs found afresh, exactly: the periods
layer_probe.with_end found in a (shared, moved) kept-layer probe, used by expanded_step; the MeshFrame every
stage of a layout shares (simulate/steps.mesh_frame), filled by the stages costed before."""
import torch
from conftest import tiny_config

from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.plan.evaluate import ProbeCache
from syntorch.simulate.steps import mesh_frame, stage_costs

HW = load_hw_config("a100-80gb")
GPT = tiny_config("gpt2", n_layer=40, d_model=64, n_head=2, d_head=32, d_ff=256, vocab_size=128)
SP = dict(tp=2, sp=True, microbatches=8, seq=32, bucket_mb=0.1)
# DeepSeek-style: 5 dense layers, then 11 MoE ones (two runs that leave layers out in one step)
MOE = tiny_config("deepseek-v3", n_layer=16, n_head=4, d_head=24, rotary_dim=8, v_head_dim=12, kv_lora_rank=16,
                  q_lora_rank=24, n_experts=8, d_ff_expert=32, d_ff=64, moe_top_k=3, first_k_dense=5,
                  moe_n_group=4, moe_topk_group=2, rope_original_positions=16)
PAIRS = {  # (plan traced first, plan predicted from its probes, moved onto its own mesh)
    "interleaved": (GPT, TrainPlan(pp=2, dp=4, virtual_stages=2, zero=1, **SP),
                    TrainPlan(pp=4, dp=2, virtual_stages=2, zero=1, **SP)),
    "two_runs": (MOE, TrainPlan(microbatches=3, seq=32), TrainPlan(microbatches=3, seq=32)),
}


def shared_probes(name: str) -> tuple[dict, TrainPlan]:
    config, first, second = PAIRS[name]
    cache = ProbeCache()
    cache.probes(config, first, torch.float32, (HW, "fused", "flash"))
    probes, _ = cache.probes(config, second, torch.float32, (HW, "fused", "flash"))
    assert any(len(probe.runs) > 1 for probe in probes.values())  # some stage left layers out of two runs
    return probes, second


def test_stored_periods_expand_as_periods_found_afresh():
    for name in PAIRS:
        probes, plan = shared_probes(name)
        for probe in probes.values():
            stored = stage_costs(probe, plan.mesh)
            probe.periods = {}  # expanded_step finds every run's periods in the step itself
            assert stage_costs(probe, plan.mesh) == stored, name


def test_a_frame_filled_by_other_stages_costs_as_a_fresh_one():
    probes, plan = shared_probes("interleaved")
    warm = {s: stage_costs(probe, plan.mesh) for s, probe in probes.items()}  # one frame, every stage
    for s, probe in probes.items():
        mesh_frame.cache_clear()
        assert stage_costs(probe, plan.mesh) == warm[s]
