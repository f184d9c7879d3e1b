"""The optimizer step as launched: Megatron's fused multi-tensor Adam under the fused profile (its memory
traffic once), torch's foreach AdamW under eager, and the gradient norm's all-reduce before the step."""
import dataclasses
import math

import pytest
import torch

from syntorch.config import get_config
from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.simulate.steps import probe_costs
from syntorch.trace.kernels import multi_tensor_launches
from syntorch.workload import trace_workload

A100 = load_hw_config("a100-80gb")
# Megatron's 22B (Korthikanti et al. 2022, Table 3): 48 layers, hidden 6144, 64 heads; at TP8 ~2.75B per rank
GPT_22B = get_config("gpt3-175b").__class__(**{**vars(get_config("gpt3-175b")), "name": "gpt-22b", "n_layer": 48,
                                                 "d_model": 6144, "n_head": 64, "d_head": 96, "d_ff": 4 * 6144})


def optimizer_us(config, plan, profile):
    workload = trace_workload(config, plan, torch.bfloat16, A100, schedule=False, profile=profile)
    probe = workload.probes[0]
    graph, blocks = probe.optimizer or probe  # a probe of fewer layers has the whole stage's optimizer step on its own
    key = ("optimizer", None, None)
    cost = probe_costs(graph, {key: blocks[key]}, plan.mesh)[key]
    params = sum(math.prod(d["shape"]) for n, d in graph.node_attrs.items()
                 if d["kind"] == "tensor" and d["name"].endswith(".master") and d["version"] == 0)
    return cost.us, params


def test_a_fused_adam_step_of_a_22b_shard_costs_its_memory_traffic_once():
    """Megatron's fused Adam with FP32 masters reads and writes ~30 bytes per parameter once (bf16 gradient
    2 + master, m, v read 12 + written 12 + the bf16 weight 2, + the norm's read of the gradient 2)."""
    plan = TrainPlan(tp=8, seq=128)
    fused, params = optimizer_us(GPT_22B, plan, "fused")
    assert 2.6e9 < params < 2.9e9
    bound_us = 1e6 * 30 * params / (A100.memory_bw_gb_s * 1e9 * A100.memory_efficiency)
    assert fused == pytest.approx(bound_us, rel=0.2)
    eager, _ = optimizer_us(GPT_22B, plan, "eager")
    assert eager > 2 * fused  # torch's foreach AdamW: a kernel (and a memory pass) per foreach op


def test_multi_tensor_apply_launches_per_320_chunks_or_per_list_of_tensors():
    assert multi_tensor_launches([65536 * 320], 4) == 1
    assert multi_tensor_launches([65536 * 320 + 1], 4) == 2
    assert multi_tensor_launches([10] * 37, 4) == 2  # 36 tensors per launch with four lists
    assert multi_tensor_launches([10] * 110, 1) == 1


NORM_CASES = [  # (plan, the group of rank 0's gradient-norm all-reduce, or None: nothing to sum it with)
    (TrainPlan(dp=2, tp=2, pp=2, microbatches=2, seq=16), [0, 1, 2, 3]),  # DDP: model parallel, TP x PP
    (TrainPlan(dp=2, tp=2, zero=1, seq=16), [0, 1, 2, 3]),  # distributed optimizer: every rank
    (TrainPlan(dp=2, pp=2, zero=3, microbatches=2, seq=16), [0, 1, 2, 3]),
    (TrainPlan(dp=2, tp=2, seq=16), [0, 1]),
    (TrainPlan(dp=2, seq=16), None),  # DDP without model parallelism: each replica's norm is the global one
]


@pytest.mark.parametrize("plan, group", NORM_CASES)
def test_the_gradient_norm_is_all_reduced_over_megatrons_group_before_the_update(plan, group):
    from conftest import tiny_config
    from syntorch.trace.training import trace_stage

    graph = trace_stage(tiny_config("gpt2", n_layer=2), plan, 0)
    optimizer = [(n, d) for n, d in graph.node_attrs.items() if d["kind"] != "tensor" and d["phase"] == "optimizer"]
    reduces = [(n, d) for n, d in optimizer if d["kind"] == "collective" and d["collective"] == "all_reduce"]
    assert [(d["group"], d["bytes"]) for _, d in reduces] == ([(group, 4)] if group else [])
    lerp = next(n for n, d in optimizer if d["name"] == "aten._foreach_lerp_")
    assert all(n < lerp for n, _ in reduces)  # the norm summed, then Adam
    off = trace_stage(tiny_config("gpt2", n_layer=2), dataclasses.replace(plan, clip_grad=0), 0)
    first = min(n for n, d in off.node_attrs.items() if d["kind"] != "tensor" and d["phase"] == "optimizer")
    assert not any(d["kind"] == "collective" and d["collective"] == "all_reduce" for _, d in off.collectives()
                   if d["phase"] == "optimizer") and off.node_attrs[first]["name"] != "aten._foreach_norm"
    assert optimizer[0][1]["name"] in ("aten._foreach_norm", "aten.square", "aten.pow")  # the norm comes first
