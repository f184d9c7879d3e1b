"""Qwen3 and Qwen3-MoE against transformers: tiny random HF folders load as they are with the same logits, greedy
and beam tokens; saved ones load back into transformers; the registry's shapes give the published counts."""
import json

import pytest
import torch
import transformers as hf

from syntorch.checkpoints import load_checkpoint, save_checkpoint
from syntorch.config import get_config
from syntorch.errors import UserError
from syntorch.generate import generate
from syntorch.hf_format import hf_config_to_model_config
from syntorch.models import build_model
from tests.models.test_llama import COMMON, GREEDY, hf_generate, ids, randomized

pytestmark = pytest.mark.usefixtures("one_thread")

# YaRN over a short original context with a narrow ramp, so kept, ramped and slowed frequencies all occur
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=4.0, beta_slow=0.5)


def make(family: str):
    """q/k norms (with wide random weights, so a norm over the wrong dims moves logits), YaRN on the dense one,
    128 -> 4 experts with and without norm_topk_prob on the MoE ones."""
    if family == "qwen3":
        return hf.Qwen3ForCausalLM(hf.Qwen3Config(rope_theta=100.0, rope_scaling=YARN, head_dim=16, **COMMON))
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, rope_theta=1e4, head_dim=8)
    return hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(norm_topk_prob=family == "qwen3_moe", **moe, **COMMON))


FAMILIES = ["qwen3", "qwen3_moe", "qwen3_moe_unnormalized"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(family, HF model, our model loaded from the folder it saved)."""
    model = randomized(make(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, model, load_checkpoint(folder)[1]


def test_logits_match_transformers(pair):
    _, model, ours = pair
    with torch.no_grad():
        ref = model(ids()).logits
        assert ref.abs().max() > 1
        assert (ours(ids()) - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("beams", [1, 3])
def test_greedy_and_beam_tokens_match_transformers(pair, beams):
    _, model, ours = pair
    prompt = ids(length=8, seed=2)
    assert generate(ours, prompt, 10, GREEDY, beam_width=beams).tokens == hf_generate(model, prompt, 10, num_beams=beams)


def test_config_mapping(pair):
    family, _, ours = pair
    c = ours.config
    assert c.qk_norm and ours.layers["1"].attn.q_norm.weight.shape == (c.d_head,)
    if family == "qwen3":
        assert (c.rope_scaling, c.rope_factor, c.rope_original_positions, c.rope_beta_fast) == ("yarn", 4.0, 16, 4.0)
    else:
        assert (c.n_experts, c.moe_top_k, c.d_ff_expert) == (4, 2, 32)
        assert c.moe_renormalize == (family == "qwen3_moe")


def test_save_round_trip_through_transformers(pair, tmp_path):
    _, model, ours = pair
    save_checkpoint(ours, tmp_path / "out")
    reloaded = hf.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded) is type(model)
    with torch.no_grad():
        assert (reloaded(ids()).logits - model(ids()).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("change,message", [
    ({"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\] is not supported"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2 is not supported"),
    ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_scaling type 'dynamic' is not supported"),
])
def test_bad_configs_are_one_line(change, message):
    config = {**make("qwen3_moe").config.to_dict(), **change}
    with pytest.raises(UserError, match=message) as e:
        hf_config_to_model_config(json.loads(json.dumps(config)))
    assert "\n" not in str(e.value)


def counts(name):
    """(total, active) parameters on meta; active: the top k of each layer's routed experts."""
    c = get_config(name)
    model = build_model(c, device="meta")
    total = sum(p.numel() for p in model.parameters())
    if not c.n_experts:
        return total, total
    expert = sum(p.numel() for p in model.layers["0"].mlp.experts[0].parameters())
    return total, total - c.n_layer * (c.n_experts - c.moe_top_k) * expert


@pytest.mark.parametrize("name,total,active", [
    # the model cards' figures (Qwen/Qwen3-*: "Number of Parameters", "Number of Activated Parameters"), which keep
    # two or three digits (30B-A3B's 3.35B active shows as 3.3B)
    ("qwen3-0.6b", 0.6, 0.6), ("qwen3-1.7b", 1.7, 1.7), ("qwen3-4b", 4.0, 4.0), ("qwen3-8b", 8.2, 8.2),
    ("qwen3-14b", 14.8, 14.8), ("qwen3-32b", 32.8, 32.8), ("qwen3-moe-30b-a3b", 30.5, 3.3),
    ("qwen3-moe-235b-a22b", 235, 22),
])
def test_registry_parameter_counts(name, total, active):
    got_total, got_active = counts(name)
    assert (got_total / 1e9, got_active / 1e9) == (pytest.approx(total, rel=0.02), pytest.approx(active, rel=0.02))
    if name == "qwen3-moe-235b-a22b":  # Qwen3 technical report, table 2's figures (235B / 22B) to the billion
        assert (round(got_total / 1e9), round(got_active / 1e9)) == (235, 22)
