"""Per-rank memory estimates (parallel/memory.py), bf16, in GB: the first stage (the most micro-batches in
flight) and the last (the logits) of
- GPT-3 175B on TP8 x PP8 (Megatron's layout, SP, micro-batch 1, 2048 tokens, 64 micro-batches) under 1F1B,
  interleaved 1F1B (V = 2, 3), GPipe and with ZeRO-1 over DP 8;
- the published layouts test_memory_estimate.py checks against 80 GB: GPT-3 175B ZeRO-3 on 384 GPUs, Llama-3.1
  405B at 128K tokens (TP8 x PP16 x CP16), Mixtral-8x7B on EP4 x TP2 x PP2.
Run: PYTHONPATH=. python bench/memory_estimate.py"""
import torch

from syntorch.config import get_config
from syntorch.parallel.memory import estimate
from syntorch.parallel.plans import TrainPlan

MEGATRON = dict(tp=8, pp=8, sp=True, microbatches=64, seq=2048)
RUNS = [("gpt3-175b", "1f1b", MEGATRON), ("gpt3-175b", "interleaved V=2", {**MEGATRON, "virtual_stages": 2}),
        ("gpt3-175b", "interleaved V=3", {**MEGATRON, "virtual_stages": 3}),
        ("gpt3-175b", "gpipe", {**MEGATRON, "schedule": "gpipe"}),
        ("gpt3-175b", "1f1b zero1 dp8", {**MEGATRON, "dp": 8, "zero": 1}),
        ("gpt3-175b", "zero3 dp384 full", dict(dp=384, zero=3, seq=2048, recompute="full")),
        ("llama-3.1-405b", "128K full", dict(dp=8, tp=8, pp=16, cp=16, sp=True, zero=2, seq=131072, microbatches=16,
                                             recompute="full")),
        ("llama-3.1-405b", "128K selective", dict(dp=8, tp=8, pp=16, cp=16, sp=True, zero=2, seq=131072,
                                                  microbatches=16, recompute="selective")),
        ("mixtral-8x7b", "ep4 tp2 pp2", dict(dp=4, ep=4, tp=2, pp=2, seq=4096, microbatches=8))]

for model, name, kw in RUNS:
    config, plan = get_config(model), TrainPlan(**kw)
    for stage in sorted({0, plan.pp - 1}):
        est = estimate(config, plan, torch.bfloat16, stage)
        print(f"{model:15s} {name:17s} stage {stage:2d}: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in est.items()))
