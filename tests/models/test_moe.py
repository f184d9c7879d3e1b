"""The MoE MLP against HuggingFace's MixtralSparseMoeBlock with the same weights, and against a dense
reference (every expert on every token, masked to the top k) for the options Mixtral lacks."""
import dataclasses

import pytest
import torch

from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.models.layers import init_weights
from syntorch.models.moe import MoE

transformers = pytest.importorskip("transformers")


def moe_config(**kw):
    fields = dict(n_layer=1, d_model=32, n_head=4, vocab_size=64, n_positions=32, d_ff=48, activation="silu",
                  gated_mlp=True, mlp_bias=False, n_experts=4, moe_top_k=2)
    return ModelConfig("tiny-moe", "gpt", **{**fields, **kw})


def build(c):
    torch.manual_seed(0)
    moe = MoE(c)
    init_weights(moe, std=0.2)  # large weights: routing decisions far apart, outputs far from zero
    return moe


def test_matches_transformers_mixtral_block():
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock

    c = moe_config()
    ours = build(c)
    hf = MixtralSparseMoeBlock(MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=4,
                                             num_experts_per_tok=2)).eval()
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.weight)
        for mine, theirs in zip(ours.experts, hf.experts):
            gate, up = mine.fc1.weight.chunk(2)
            theirs.w1.weight.copy_(gate)
            theirs.w3.weight.copy_(up)
            theirs.w2.weight.copy_(mine.fc2.weight)
    x = torch.randn(3, 7, 32)
    expected, _ = hf(x)
    torch.testing.assert_close(ours(x), expected, rtol=0, atol=1e-5)


def dense_reference(moe, x, renormalize):
    probs = moe.router(x).softmax(-1)  # [B, T, E]
    kth = probs.topk(moe.top_k, -1).values[..., -1:]
    weights = probs * (probs >= kth)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    every = torch.stack([expert(x) for expert in moe.experts], -2)  # [B, T, E, d]
    return (weights[..., None] * every).sum(-2)


@pytest.mark.parametrize("renormalize", [True, False])
def test_shared_experts_and_unnormalized_weights(renormalize):
    c = moe_config(n_experts=8, moe_top_k=3, d_ff_expert=8, n_shared_experts=2, moe_renormalize=renormalize)
    moe = build(c)
    assert moe.shared.fc1.weight.shape == (32, 32) and moe.experts[0].fc1.weight.shape == (16, 32)  # [gate; up]
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(moe(x), dense_reference(moe, x, renormalize) + moe.shared(x), rtol=0, atol=1e-5)


def test_meta_routes_uniformly():
    moe = MoE(moe_config(n_experts=3))
    x = torch.empty(2, 5, 32, device="meta")
    assert moe.tokens_per_expert(torch.empty(20, dtype=torch.long, device="meta")) == [7, 7, 6]
    assert moe(x).shape == (2, 5, 32) and moe(x).is_meta


def test_top_k_above_expert_count():
    with pytest.raises(UserError, match=r"moe_top_k must be between 1 and n_experts \(4\), got 5"):
        moe_config(moe_top_k=5)
    with pytest.raises(UserError, match="n_experts must be an integer >= 0"):
        dataclasses.replace(moe_config(), n_experts=-1)


def test_meta_routes_by_a_stated_load():
    moe = MoE(moe_config())
    moe.symbolic_load = [0.5, 0.25, 0.125, 0.125]
    assert moe.tokens_per_expert(torch.empty(18, dtype=torch.long, device="meta")) == [9, 5, 2, 2]  # 9, 4.5, 2.25, 2.25
