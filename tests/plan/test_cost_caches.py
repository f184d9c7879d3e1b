"""The search's per-probe shortcut gives what the plain path gives: fill_durations' one kernel_us per distinct
kernel is node_us of each node."""
import torch
from conftest import tiny_config

from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.plan.evaluate import ProbeCache
from syntorch.trace.cost import fill_durations, kernel_plan, node_us

A100, H100 = load_hw_config("a100-80gb"), load_hw_config("h100-sxm")
GPT = tiny_config("gpt2", n_layer=8, d_model=128, n_head=4, d_head=32, d_ff=512, vocab_size=128)
PLAN = TrainPlan(pp=2, dp=4, zero=1, tp=2, sp=True, microbatches=8, seq=32, bucket_mb=0.1)


def _probes(cache, plan, hw):
    return cache.probes(GPT, plan, torch.float32, (hw, "fused", "flash"))[0]


def test_fill_durations_is_node_us_of_each_node():
    probe = _probes(ProbeCache(), PLAN, A100)[0]
    graph = probe[0]
    fill_durations(graph, H100, "fused")
    timed = [(n, d) for n, d in graph.node_attrs.items() if d["kind"] != "tensor"]
    assert len({d["duration_us"] for _, d in timed}) > 10
    plan = kernel_plan(graph, "fused")  # node_us's own plan, made once for every node as its docstring offers
    # (it made it again for each node: ~14 CPU s); each node's kernel is still found and costed on its own
    assert all(d["duration_us"] == node_us(graph, n, H100, "fused", plan) for n, d in timed)
