"""Traced FLOPs of grouped-query attention, SwiGLU and the MoE MLP against counts written out by hand
(2 FLOPs per multiply-add; attention over the T(T+1)/2 query-key pairs the causal mask keeps, as flash kernels
compute them, and over all T x T scores in `dense_flops`, as torch's flop_counter counts them)."""
import pytest
import torch

from syntorch.models import build_model
from syntorch.trace import Tracer
from tests.conftest import tiny_config

B, T = 2, 12


def analytic_forward(c) -> tuple[int, int]:
    """(forward FLOPs of everything but attention scores, attention's over all T x T scores) for B x T tokens."""
    n, d, D = B * T, c.d_model, c.d_head
    qkv = 2 * n * d * (c.n_head + 2 * c.kv_heads) * D  # K/V projections are n_head / n_kv_head times smaller
    proj = 2 * n * c.n_head * D * d
    if c.n_experts:  # every token through moe_top_k experts (whatever the routing) + the router
        f = c.expert_d_ff
        mlp = 2 * n * d * c.n_experts + c.moe_top_k * 2 * n * 3 * d * f + 2 * n * 3 * d * f * c.n_shared_experts
    else:  # gate, up and down
        mlp = 2 * n * 3 * d * c.d_ff
    scores = 2 * (2 * B * c.n_head * T * T * D)  # q k^T and p v, per query head
    return c.n_layer * (qkv + proj + mlp) + 2 * n * d * c.vocab_size, c.n_layer * scores


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("base,fields", [
    ("llama-3-8b", dict(n_head=8, n_kv_head=2, d_head=8, d_ff=96)),
    ("mixtral-8x7b", dict(n_head=8, n_kv_head=4, d_head=8, d_ff=48, n_experts=4, moe_top_k=2)),
    ("mixtral-8x7b", dict(n_head=4, n_kv_head=1, d_head=16, n_experts=8, moe_top_k=3, d_ff_expert=16,
                          n_shared_experts=2)),
])
def test_traced_flops_match_analytic_counts(base, fields, device):
    c = tiny_config(base, rotary_dim=0, **fields)
    model = build_model(c, device=device).train()
    with Tracer(model) as tracer:
        model(torch.randint(0, c.vocab_size, (B, T), device=device)).sum().backward()
    graph = tracer.graph
    dense, scores = analytic_forward(c)
    causal = scores // (T * T) * (T * (T + 1) // 2)  # the pairs key <= query, the diagonal included
    for key, attention in (("flops", causal), ("dense_flops", scores)):
        phase = {p: sum(d.get(key, d["flops"]) for _, d in graph.ops() if d["phase"] == p)
                 for p in ("forward", "backward")}
        assert phase["forward"] == dense + attention
        # backward: two matmuls per linear (input and weight gradients); attention's five score-sized products
        assert phase["backward"] == 2 * dense + attention // 4 * 10


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("base", ["mistral-7b", "mixtral-8x7b"])
def test_layer_replication_equals_a_full_trace(base, device):
    """On meta (uniform routing) every layer is the same, so one traced layer stands for all; real MoE layers
    route tokens each their own way, so there the default traces every layer."""
    from syntorch.generate import Sampling
    from syntorch.trace import trace_generation

    c = tiny_config(base, n_layer=3, n_head=8, n_kv_head=2, d_head=8, rotary_dim=0, sliding_window=4,
                    n_experts=4 if "mixtral" in base else 0)
    model = build_model(c, device=device)
    prompt = torch.randint(0, 50, (2, 5), device=device)
    full, _ = trace_generation(model, prompt, 3, Sampling(temperature=0), replicate=False)
    default, _ = trace_generation(model, prompt, 3, Sampling(temperature=0))
    assert len(default) == len(full) > 0
    assert dict(default.nodes(data=True)) == dict(full.nodes(data=True))
    assert sorted(default.edges(data="arg")) == sorted(full.edges(data="arg"))
