"""INT8 weight-only (syntorch/quant.py) and half precision on CPU, against FP32 of the same weights.

The models are GPT-2-shaped (d 768, 12 heads; 4 layers and a 4096-token vocabulary to stay fast). With every weight at
GPT-2's initializer range 0.02 random logits are nearly flat and any rounding flips the argmax. Drawing every
weight at 0.3 instead makes the random network chaotic: q and k grow to std ~8, attention scores to std ~70,
so softmax is a hard argmax that any rounding re-routes; there even fp16 (11-bit mantissa) agrees with fp32 on
only ~78% of positions and bf16 on ~56% (bench/precision_agreement.py prints these). So the token embedding (and the
tied head it is) is drawn at 0.3, which makes logits peaked (std ~8), and the layers at GPT-2's 0.02.
Agreement is counted per position while both runs read the FP32 run's greedy tokens (teacher forcing), so
one early flip does not count as every later position lost; the free-running share is checked too.
"""
import copy
import dataclasses

import pytest
import torch
from torch.utils.flop_counter import flop_registry

from syntorch.config import get_config
from syntorch.generate import Sampling, generate, stream_friendly_weights
from syntorch.models import build_model
from syntorch.models.layers import init_weights
from syntorch.quant import Int8Weight, quantize_int8_weight_only, quantize_weight, weight_bytes
from syntorch.trace.generation import trace_generation

NEW_TOKENS = 64
VOCAB = 4096


def gpt2_shaped(n_layer: int = 4, embedding_std: float = 0.3, std: float = 0.02) -> torch.nn.Module:
    config = dataclasses.replace(get_config("gpt2"), n_layer=n_layer, n_positions=128, vocab_size=VOCAB)
    torch.manual_seed(0)
    model = build_model(config)
    init_weights(model, std=std, residual_layers=n_layer)
    torch.nn.init.normal_(model.tok_emb.weight, std=embedding_std)  # the tied head too
    return model.eval()


def greedy(model, prompt) -> list[int]:
    return generate(model, prompt, NEW_TOKENS, Sampling(temperature=0)).tokens[0][prompt.shape[1]:]


def forced_agreement(model, reference, prompt, continuation) -> tuple[float, float]:
    """(share of positions whose argmax equals the reference's, relative L2 error of the logits), both models
    reading the prompt and the reference's own greedy continuation."""
    with torch.inference_mode():
        ids = torch.tensor([prompt[0].tolist() + continuation])
        want = reference(ids)[0, prompt.shape[1] - 1:-1].float()
        got = model(ids)[0, prompt.shape[1] - 1:-1].float()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    return agree, ((got - want).norm() / want.norm()).item()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def fp32(prompt):
    """The FP32 model, its greedy tokens, and a copy of it as gpt2_shaped() made it, for each test to copy
    (building one again costs ~1 CPU s, a copy ~0.2)."""
    model = gpt2_shaped()
    pristine = copy.deepcopy(model)
    return model, greedy(model, prompt), pristine


def test_quantized_weight_is_symmetric_per_output_channel():
    w = torch.tensor([[0.5, -1.0, 0.25], [2.0, 1.0, -0.5]])
    q = quantize_weight(w)
    assert q.dtype == torch.int8 and torch.allclose(q.scale, torch.tensor([1.0, 2.0]) / 127)
    assert q.tolist() == [[64, -127, 32], [127, 64, -32]]  # round(w / scale)
    x = torch.randn(3, 3)
    deq = torch.tensor(q.tolist(), dtype=torch.float32) * q.scale[:, None]
    assert torch.allclose(torch.nn.functional.linear(x, q), x @ deq.t(), atol=1e-6)


def test_int8_weight_only_agrees_with_fp32_and_stores_a_quarter(fp32, prompt):
    reference, tokens, pristine = fp32
    model = copy.deepcopy(pristine)
    done = quantize_int8_weight_only(model)
    assert len(done) == 4 * 4 and "lm_head" not in done  # qkv, proj, fc1, fc2 per layer; the head stays
    assert model.lm_head.weight.dtype == torch.float32 and model.lm_head.weight is model.tok_emb.weight
    fp_bytes = sum(reference.get_submodule(n).weight.numel() * 4 for n in done)
    int8_bytes = sum(model.get_submodule(n).weight.numel() + model.get_submodule(n).weight_scale.numel() * 4
                     for n in done)
    assert 3.9 < fp_bytes / int8_bytes <= 4
    assert weight_bytes(reference) - weight_bytes(model) == fp_bytes - int8_bytes
    stream_friendly_weights(model)  # as infer does: it must leave the int8 weights as they are
    assert isinstance(model.layers["0"].attn.qkv.weight, Int8Weight)
    agree, rel = forced_agreement(model, reference, prompt, tokens)
    free = sum(a == b for a, b in zip(greedy(model, prompt), tokens)) / NEW_TOKENS
    print(f"int8 weight-only vs fp32: {agree:.1%} of {NEW_TOKENS} positions agree (free-running {free:.1%}), "
          f"logits' relative error {rel:.3%}")
    assert agree >= 0.9 and free >= 0.5
    assert 0 < rel < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_on_cpu_close_to_fp32(dtype, fp32, prompt):
    reference, tokens, pristine = fp32
    half = copy.deepcopy(pristine).to(dtype)
    stream_friendly_weights(half)
    assert half.lm_head.weight.dtype == dtype and half.lm_head.weight.is_contiguous()  # layout kept for half
    agree, rel = forced_agreement(half, reference, prompt, tokens)
    free = sum(a == b for a, b in zip(greedy(half, prompt), tokens)) / NEW_TOKENS
    print(f"{dtype} vs fp32: {agree:.1%} of {NEW_TOKENS} positions agree (free-running {free:.1%}), "
          f"logits' relative error {rel:.3%}")
    assert agree >= 0.9 and free >= 0.5 and 0 < rel < 0.05


def test_int8_in_a_symbolic_trace_reads_int8_bytes():
    model = build_model(dataclasses.replace(get_config("gpt2"), n_layer=2), device="meta")
    quantize_int8_weight_only(model)
    graph, _ = trace_generation(model, torch.zeros(1, 4, dtype=torch.long, device="meta"), 2, Sampling(temperature=0))
    ops = [(n, d) for n, d in graph.ops() if d["name"] == "aten._weight_int8pack_mm"]
    assert len(ops) == 2 * 4 * 2  # 2 layers x 4 Linears x (prefill + 1 decode step)
    node, qkv = next((n, d) for n, d in ops if d["module"] == "layers.0.attn.qkv" and d["phase"] == "prefill")
    weight = next(graph.nodes[t] for t in graph.preds[node] if graph.nodes[t]["name"] == "layers.0.attn.qkv.weight")
    assert (weight["dtype"], weight["bytes"], weight["is_param"]) == ("int8", 768 * 2304, True)
    assert qkv["flops"] == 2 * 4 * 768 * 2304 + 768 * 2304
    assert torch.ops.aten._weight_int8pack_mm not in flop_registry  # syntorch's formula; torch's registry untouched
