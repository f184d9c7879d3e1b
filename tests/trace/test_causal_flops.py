"""Attention FLOPs as flash kernels spend them: a causal mask's kept (query, key) pairs, the diagonal included,
against counts written out by hand and against the masks' own values; timing by those FLOPs; both MFUs."""
import dataclasses

import pytest
import torch
from conftest import tiny_config

from syntorch.hardware import load_hw_config
from syntorch.models import build_model
from syntorch.parallel.context import ContextSplit
from syntorch.parallel.plans import TrainPlan
from syntorch.simulate.prediction import predict_training
from syntorch.trace import Tracer
from syntorch.trace.attention import SDPA
from syntorch.trace.cost import kernel_of, kernel_us
from syntorch.workload import trace_workload

B, T = 2, 8


def attention_ops(base, device="cpu", seq=T):
    c = tiny_config(base, n_positions=max(seq, 64))
    model = build_model(c, device=device).train()
    with Tracer(model) as tracer:
        model(torch.randint(0, c.vocab_size, (B, seq), device=device)).sum().backward()
    graph = tracer.graph
    ops = {d["phase"]: d for _, d in graph.ops() if d["name"].startswith(SDPA) and d["module"] == "layers.0.attn"}
    return c, graph, ops


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_causal_attention_counts_the_lower_triangle_with_its_diagonal(device):
    c, graph, ops = attention_ops("gpt2", device)
    counting = [d for _, d in graph.ops() if d["module"].endswith("attn") and d["name"] in ("aten.arange", "aten.sum")]
    assert not counting  # the pairs are counted in plain integers, not by traced ops
    full = 2 * 2 * B * c.n_head * T * T * c.d_head  # QK^T and PV over every score
    kept = full // (T * T) * (T * (T + 1) // 2)
    assert (ops["forward"]["flops"], ops["forward"]["dense_flops"]) == (kept, full)
    assert (ops["backward"]["flops"], ops["backward"]["dense_flops"]) == (kept // 4 * 10, full // 4 * 10)


def test_bidirectional_attention_counts_every_score():
    c, _, ops = attention_ops("bert-base-uncased")
    full = 2 * 2 * B * c.n_head * T * T * c.d_head
    assert ops["forward"]["flops"] == ops["forward"]["dense_flops"] == full


@pytest.mark.parametrize("start,queries,window", [(0, 8, 0), (5, 3, 0), (5, 3, 4), (0, 8, 3), (9, 1, 4)])
def test_a_causal_by_slot_mask_says_the_pairs_it_keeps(start, queries, window):
    """With a KV cache (queries start.. over start + queries keys), and a sliding window: the count the tracer
    reads on meta equals the True entries of the mask computed on CPU."""
    attention = build_model(tiny_config("mistral-7b", n_kv_head=2, sliding_window=window)).layers["0"].attn
    mask, is_causal = attention.attention_mask(start, queries, start + queries, None, "cpu")
    if mask is None:  # no cache offset and no window: sdpa's own causal mask
        assert is_causal and start == 0 and not window
        return
    assert mask.attended_pairs == mask.sum().item() < mask.numel()


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_masks_keep_each_ranks_equal_share(cp):
    seq = 32
    shares = [ContextSplit(seq, cp, r, "cpu").mask for r in range(cp)]
    assert [m.attended_pairs for m in shares] == [m.sum().item() for m in shares] == [seq * (seq + 1) // 2 // cp] * cp


def test_flash_attention_is_timed_by_its_flops_and_the_unfused_core_by_every_score():
    hw = load_hw_config("a100-80gb")
    _, graph, _ = attention_ops("gpt2", device="meta", seq=256)
    for node, d in graph.ops():
        if d["name"].startswith(SDPA):
            kernel = kernel_of(graph, node, {})
            dense = dataclasses.replace(kernel, flops=d["dense_flops"])
            # math-bound at 256 queries: a flash kernel does not run the masked part, in either profile
            for profile in ("eager", "fused"):
                assert kernel_us(kernel, hw, profile) < kernel_us(dense, hw, profile)
            # the unfused core computes every score; PyTorch's math path also adds the mask as a kernel of its own
            assert kernel_us(kernel, hw, "fused", "unfused") == kernel_us(dense, hw, "fused", "unfused")
            if d["name"] == SDPA:
                assert kernel_us(kernel, hw, "eager", "unfused") > kernel_us(dense, hw, "eager", "unfused")


@pytest.mark.parametrize("base,causal", [("gpt2", True), ("bert-base-uncased", False)])
def test_summary_reports_mfu_with_and_without_the_causal_discount(base, causal):
    hw = load_hw_config("a100-80gb")
    config = tiny_config(base, vocab_size=256)
    plan = TrainPlan(dp=2, tp=2, microbatches=2, seq=32)
    workload = trace_workload(config, plan, torch.float32, hw)
    predicted = predict_training(workload.probes, workload.source, plan, hw).summary
    # the two model FLOPs differ by 3 x (dense - kept) of every forward attention op, on every rank
    discount = sum(3 * (d["dense_flops"] - d["flops"]) for g in workload.stages for _, d in g.ops()
                   if d["name"] == SDPA and d["phase"] == "forward") * plan.dp * plan.tp
    assert predicted["model_flops_dense_attention"] - predicted["model_flops"] == discount
    assert (discount > 0) == causal
    assert predicted["mfu_dense_attention"] / predicted["mfu"] == pytest.approx(
        predicted["model_flops_dense_attention"] / predicted["model_flops"], rel=1e-12)
    assert set(predicted["mfu_conventions"]) == {"mfu", "mfu_dense_attention"}
