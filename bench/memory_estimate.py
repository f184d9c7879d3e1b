"""Per-rank memory estimates (parallel/memory.py) of GPT-3 175B on TP8 x PP8 (Megatron's layout, bf16, SP,
micro-batch 1, 2048 tokens, 64 micro-batches) under 1F1B, interleaved 1F1B (V = 2, 3) and GPipe: stage 0
(the most micro-batches in flight) and the last stage. Run: PYTHONPATH=. python bench/memory_estimate.py"""
import torch

from syntorch.config import get_config
from syntorch.parallel.memory import estimate
from syntorch.parallel.plans import TrainPlan

config = get_config("gpt3-175b")
for name, extra in [("1f1b", {}), ("interleaved V=2", {"virtual_stages": 2}), ("interleaved V=3", {"virtual_stages": 3}),
                    ("gpipe", {"schedule": "gpipe"}), ("1f1b zero1 dp8", {"dp": 8, "zero": 1})]:
    plan = TrainPlan(tp=8, pp=8, sp=True, microbatches=64, seq=2048, **extra)
    for stage in (0, plan.pp - 1):
        est = estimate(config, plan, torch.bfloat16, stage)
        print(f"{name:18s} stage {stage}: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in est.items()) + " GB")
