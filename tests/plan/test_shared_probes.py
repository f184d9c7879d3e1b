"""Layouts that share probes (plan/evaluate.py's layer_key: another pipeline depth, and so another DP degree
on the same GPUs) predict what probes of their own do: step, bubble, exposed communication and MFU within
0.1%; the second layout traces only what it does not share."""
import pytest
import torch
from conftest import tiny_config

from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.plan.evaluate import ProbeCache, predict_plan

HW = load_hw_config("a100-80gb")
GPT = tiny_config("gpt2", n_layer=24, d_model=128, n_head=4, d_head=32, d_ff=512, vocab_size=128)
LLAMA = tiny_config("llama-3-8b", n_layer=20, d_model=128, n_head=4, n_kv_head=2, d_head=32, d_ff=256,
                    vocab_size=128)
SP = dict(tp=2, sp=True, microbatches=8, seq=32, bucket_mb=0.1)

PAIRS = {  # (plan traced first, plan predicted from its probes, probes the second one traces)
    # 12 and 6 layers per stage: the first and last stage's kept layers shared, the middle one and each
    # stage's end of backward and optimizer traced
    "zero1_sp": (GPT, TrainPlan(pp=2, dp=4, zero=1, **SP), TrainPlan(pp=4, dp=2, zero=1, **SP), 4),
    "ddp_sp": (GPT, TrainPlan(pp=2, dp=4, **SP), TrainPlan(pp=4, dp=2, **SP), 4),
    "ddp_cp": (LLAMA, TrainPlan(pp=2, dp=2, cp=2, microbatches=4, seq=64, bucket_mb=0.1),
               TrainPlan(pp=4, dp=4, cp=2, microbatches=4, seq=64, bucket_mb=0.1), 4),
    # interleaved over a ring of 2 and of 4 stages (5 and 10 layers per chunk)
    "interleaved": (tiny_config("gpt2", n_layer=40, d_model=64, n_head=2, d_head=32, d_ff=256, vocab_size=128),
                    TrainPlan(pp=2, dp=4, virtual_stages=2, zero=1, **SP),
                    TrainPlan(pp=4, dp=2, virtual_stages=2, zero=1, **SP), 4),
    # the same under DDP: each chunk's last backward launches its own buckets
    "interleaved_ddp": (tiny_config("gpt2", n_layer=40, d_model=64, n_head=2, d_head=32, d_ff=256, vocab_size=128),
                        TrainPlan(pp=2, dp=4, virtual_stages=2, **SP),
                        TrainPlan(pp=4, dp=2, virtual_stages=2, **SP), 4),
    "fsdp": (GPT, TrainPlan(pp=2, dp=2, zero=3, microbatches=4, seq=32), TrainPlan(pp=4, dp=2, zero=3, microbatches=4,
                                                                                  seq=32), 4),
    # the micro-batch size changes the kept layers' probe, not the end of backward or the optimizer's
    "micro_batch_size": (GPT, TrainPlan(pp=2, dp=4, zero=1, **SP),
                         TrainPlan(pp=2, dp=4, zero=1, micro_batch_size=2, **{**SP, "microbatches": 4}), 2),
}


@pytest.mark.parametrize("name", PAIRS)
def test_a_shared_probe_predicts_what_a_fresh_one_does(name):
    config, first, second, traced = PAIRS[name]
    cache = ProbeCache()
    predict_plan(config, first, HW, cache, torch.float32)
    before = cache.traced
    shared = predict_plan(config, second, HW, cache, torch.float32).summary
    assert cache.traced - before == traced
    fresh = predict_plan(config, second, HW, ProbeCache(), torch.float32).summary
    for key in ("step_s", "exposed_comm_s", "mfu"):
        assert shared[key] == pytest.approx(fresh[key], rel=1e-3), key
    assert shared["bubble_fraction"] == pytest.approx(fresh["bubble_fraction"], abs=1e-3)
