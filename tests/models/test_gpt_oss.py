"""GPT-OSS against transformers: a tiny random HF folder (alternating windowed and full layers, sinks, attention
and expert biases, a biased router, the clamped SwiGLU with HF's interleaved gate_up_proj, YaRN) loads as it is
with the same logits, greedy and beam tokens; a saved one loads back into transformers; the registry's shapes
give the published counts; MXFP4 folders are refused in one line."""
import json

import pytest
import torch
import transformers as hf

from syntorch.checkpoints import lazy_checkpoint, load_checkpoint, save_checkpoint
from syntorch.errors import UserError
from syntorch.generate import generate
from syntorch.hf_format import hf_config_to_model_config
from syntorch.models.gpt_oss import sink_attention
from tests.models.test_llama import COMMON, GREEDY, hf_generate, ids, randomized
from tests.models.test_qwen3 import counts

pytestmark = pytest.mark.usefixtures("one_thread")

YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=4.0, beta_slow=0.5,
            truncate=False)


def make(n_layer=3):
    """Window 4, shorter than every prompt; 3 layers: windowed, full, windowed; 4 experts, top 2."""
    config = hf.GptOssConfig(**{**COMMON, "num_hidden_layers": n_layer, "intermediate_size": 32},
                             head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                             rope_theta=100.0, rope_scaling=dict(YARN))
    return randomized(hf.GptOssForCausalLM(config))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = make()
    folder = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(folder)
    return model, folder, load_checkpoint(folder)[1]


def test_logits_match_transformers(pair):
    model, _, ours = pair
    with torch.no_grad():
        ref = model(ids(length=20)).logits
        assert ref.abs().max() > 1
        assert (ours(ids(length=20)) - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("beams", [1, 3])
def test_greedy_and_beam_tokens_match_transformers(pair, beams):
    model, _, ours = pair
    prompt = ids(length=8, seed=2)
    assert generate(ours, prompt, 10, GREEDY, beam_width=beams).tokens == hf_generate(model, prompt, 10, num_beams=beams)


def test_config_mapping_and_layer_windows(pair):
    _, _, ours = pair
    c = ours.config
    assert (c.sliding_window, c.sliding_window_pattern, c.swiglu_limit, c.n_experts, c.moe_top_k) == (4, 2, 7.0, 4, 2)
    assert (c.rope_scaling, c.rope_truncate, c.attn_sinks, c.router_bias, c.qkv_bias, c.mlp_bias) == (
        "yarn", False, True, True, True, True)
    assert [ours.layers[str(i)].attn.sliding_window for i in range(3)] == [4, 0, 4]


def test_save_round_trip_through_transformers(pair, tmp_path):
    model, _, ours = pair
    save_checkpoint(ours, tmp_path / "out")
    reloaded = hf.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded) is hf.GptOssForCausalLM and reloaded.config.layer_types == model.config.layer_types
    with torch.no_grad():
        assert (reloaded(ids()).logits - model(ids()).logits).abs().max().item() <= 1e-5


def test_lazy_reads_give_the_loaded_experts(pair):
    """A rank's lazy view of the stacked expert tensors (rows of one expert, de-interleaved) equals the full load."""
    _, folder, ours = pair
    _, lazy = lazy_checkpoint(folder)
    fc1 = ours.layers["2"].mlp.experts[3].fc1
    assert torch.equal(lazy["layers.2.mlp.experts.3.fc1.weight"][5:40], fc1.weight[5:40])
    assert torch.equal(lazy["layers.2.mlp.experts.3.fc1.bias"][:], fc1.bias)


def test_sinks_are_a_share_of_the_softmax():
    """Against the definition: softmax over [scores, sink] with the sink's column dropped."""
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    sinks = torch.randn(4)
    mask = torch.ones(5, 7, dtype=torch.bool).tril(2)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 8 ** 0.5).masked_fill(~mask, float("-inf"))
    probs = torch.cat((scores, sinks.view(1, 4, 1, 1).expand(2, 4, 5, 1)), -1).softmax(-1)[..., :-1]
    expected = probs @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(sink_attention(q, k, v, sinks, mask, False, enable_gqa=True), expected)


@pytest.mark.parametrize("change,message", [
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config 'mxfp4'.*dequantize first"),
    ({"layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}, "layer_types .* is not every"),
    ({"swiglu_limit": 10.0}, "swiglu_limit=10.0 is not supported"),
])
def test_bad_configs_are_one_line(change, message):
    config = {**make(3).config.to_dict(), **change}
    with pytest.raises(UserError, match=message) as e:
        hf_config_to_model_config(json.loads(json.dumps(config)))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name,total,active", [
    # OpenAI's gpt-oss model card (2025), table 1: total 116.83B / 20.91B, active per token 5.13B / 3.61B, where
    # active counts the unembedding but not the embedding
    ("gpt-oss-120b", 116.83e9, 5.13e9), ("gpt-oss-20b", 20.91e9, 3.61e9),
])
def test_registry_parameter_counts(name, total, active):
    from syntorch.config import get_config
    c = get_config(name)
    got_total, got_active = counts(name)
    assert round(got_total, -7) == total and round(got_active - c.vocab_size * c.d_model, -7) == active
