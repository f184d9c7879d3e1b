"""The work of a decode step outside the layers, and the host that issues an eager step's kernels.

A sampled step gathers the vocabulary-parallel logits and sorts (top-p) or radix-selects (top-k) over the whole
vocabulary, as FasterTransformer's sampling layers and PyTorch's CUDA kernels do: the sort's passes are cub's
(6 key bits each), the selection's PyTorch's (8 bits each). Under the eager profile each kernel starts no
earlier than the host issues it: checked against the closed form of a queue fed at one kernel per host_us."""
import dataclasses

import pytest
import torch
from conftest import tiny_config

from syntorch.generate import Sampling, generate
from syntorch.hardware import config_from_dict, load_hw_config
from syntorch.parallel.mesh import Mesh
from syntorch.trace.cost import fill_durations, kernel_of, kernel_plan
from syntorch.trace.generation import trace_pp_stage, trace_tp_run

A100 = load_hw_config("a100-80gb")
B, VOCAB, TP = 3, 1000, 2
CONFIG = tiny_config(vocab_size=VOCAB)


def decode_trace(sampling: Sampling, tp: int = TP, config=CONFIG, batch: int = B, new_tokens: int = 3):
    prompt = torch.zeros(batch, 5, dtype=torch.long, device="meta")
    graph, _ = trace_tp_run(config, lambda m, scope: generate(m, prompt, new_tokens, sampling, phase_scope=scope),
                            tp, 0, dtype=torch.float16)
    return graph


def step_ops(graph, name: str, phase: str = "decode[0]") -> list:
    return [n for n, d in graph.node_attrs.items() if d["kind"] != "tensor" and d["phase"] == phase
            and d.get("name") == name]


def test_a_top_p_step_gathers_the_logits_and_sorts_the_whole_vocabulary_in_cub_passes():
    graph = decode_trace(Sampling(top_p=0.9, seed=0))
    nodes = graph.node_attrs
    gather, = [n for n in step_ops(graph, "c10d._allgather_base_") if nodes[n]["module"] == "lm_head"]
    padded = -(-VOCAB // (128 * TP)) * 128 * TP  # Megatron's padding of the vocabulary to 128 x TP
    assert nodes[gather]["bytes"] == B * padded * 2  # FP16 logits of every rank
    sort, = step_ops(graph, "aten.sort")
    assert nodes[next(iter(graph.preds[sort]))]["shape"] == [B, VOCAB]  # padding sliced off before sampling
    # FP32 keys with int64 indices: ceil(32 / 6) = 6 passes, each reading the keys twice and the indices once
    # and writing both (cub's segmented radix sort)
    kernel = kernel_of(graph, sort, kernel_plan(graph, "eager"))
    assert kernel.nbytes == 6 * B * VOCAB * (3 * 4 + 2 * 8)
    assert len(step_ops(graph, "aten._softmax")) >= 1
    # the gathered [tp, B, V/tp] chunks copied into rows: a kernel even under the fused profile (Megatron's
    # torch.cat along the last dimension, FasterTransformer's transpose after its all-gather); the FP32 cast
    # for sampling joins it (its output written as FP32: 2 more bytes a logit)
    cat, = [n for n in step_ops(graph, "aten.cat") if nodes[n]["module"] == "lm_head"]
    assert kernel_of(graph, cat, kernel_plan(graph, "fused")).nbytes == 2 * B * padded * 2 + B * VOCAB * 2


def test_tensor_parallel_ranks_share_no_ids_and_pipeline_stages_broadcast_one_per_row():
    """FasterTransformer's ParallelGpt samples on every TP rank from the gathered logits with one seed (no
    broadcast among them); its last pipeline stage sends the chosen ids on. Ours the same: B int64 ids a step."""
    graph = decode_trace(Sampling(top_p=0.9, seed=0))
    step = {graph.node_attrs[n]["collective"] for n, d in graph.node_attrs.items()
            if d["kind"] == "collective" and d["phase"] == "decode[0]"}
    assert step == {"all_reduce", "all_gather"}  # the layers', the embedding's, the logits'
    prompt = torch.zeros(B, 5, dtype=torch.long, device="meta")
    last, _ = trace_pp_stage(tiny_config(n_layer=2, vocab_size=VOCAB), lambda m, scope, forward: generate(
        m, prompt, 3, Sampling(top_p=0.9, seed=0), phase_scope=scope, forward=forward), Mesh(pp=2), 1,
        dtype=torch.float16)
    ids = [d for d in last.node_attrs.values() if d["kind"] == "collective" and d["phase"] == "decode[0]"
           and d["collective"] == "broadcast"]
    assert [d["bytes"] for d in ids] == [B * 8]


def test_a_top_k_step_radix_selects_over_the_vocabulary():
    k = 7
    graph = decode_trace(Sampling(top_k=k, seed=0))
    topk, = step_ops(graph, "aten.topk")
    # four 8-bit passes over the FP32 logits, a fifth to gather, then k values and int64 indices per row
    assert kernel_of(graph, topk, kernel_plan(graph, "eager")).nbytes == 5 * B * VOCAB * 4 + B * k * (4 + 8)


def test_a_greedy_step_neither_sorts_nor_selects():
    graph = decode_trace(Sampling(temperature=0))
    assert not step_ops(graph, "aten.sort") and not step_ops(graph, "aten.topk")
    assert step_ops(graph, "aten.argmax")


def kernel_durations(graph, phase: str) -> list[float]:
    return [d["duration_us"] for d in graph.node_attrs.values()
            if d["kind"] != "tensor" and d["phase"] == phase and d.get("duration_us")]


@pytest.mark.parametrize("d_model, batch", [(64, 1), (2048, 64)])
def test_an_eager_step_runs_as_a_queue_the_host_feeds_one_kernel_per_host_overhead(d_model, batch):
    """A step's time is max over k of (k + 1) x host_us + the GPU time of kernels k.. (the host syncs at the
    step's start, then issues a kernel per host_us; each starts once issued and once the one before ended):
    host-bound for a tiny model, about the GPU time (plus one launch) when its kernels are long."""
    config = tiny_config(d_model=d_model, d_head=d_model // 4, d_ff=4 * d_model, vocab_size=VOCAB)
    graph = decode_trace(Sampling(top_p=0.9, seed=0), tp=1, config=config, batch=batch)
    fill_durations(graph, dataclasses.replace(A100, host_overhead_us=0.0), "eager")
    gpu = {phase: kernel_durations(graph, phase) for phase in ("prefill", "decode[0]", "decode[1]")}
    host_us = A100.host_overhead_us
    fill_durations(graph, A100, "eager")
    for phase, g in gpu.items():
        queue = max((k + 1) * host_us + sum(g[k:]) for k in range(len(g)))
        assert sum(kernel_durations(graph, phase)) == pytest.approx(queue)
        assert queue >= len(g) * host_us
    if d_model == 64:  # kernels of a few µs: the host's rate
        assert sum(gpu["decode[0]"]) < 0.5 * len(gpu["decode[0]"]) * host_us


def test_the_fused_profile_is_not_host_bound():
    """FasterTransformer's C++ loop issues kernels faster than the GPU drains them: no host waits."""
    graph = decode_trace(Sampling(top_p=0.9, seed=0), tp=1)
    fill_durations(graph, A100, "fused")
    with_host = [d.get("duration_us") for d in graph.node_attrs.values()]
    fill_durations(graph, dataclasses.replace(A100, host_overhead_us=0.0), "fused")
    assert with_host == [d.get("duration_us") for d in graph.node_attrs.values()]


def test_only_gpu_presets_have_a_host_to_wait_for():
    assert load_hw_config("h100-sxm").host_overhead_us == A100.host_overhead_us == 8.0
    # a CPU device's kernel_overhead_us is its dispatch: a file without the field waits for no host
    fields = {k: v for k, v in A100.to_dict().items() if k != "host_overhead_us"}
    assert config_from_dict(fields).host_overhead_us == 0.0
