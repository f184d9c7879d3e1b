"""One YaRN for every family: the rotary frequencies and the cos/sin gain our config.json reading gives equal
transformers' own _compute_yarn_parameters on Qwen3, GPT-OSS, DeepSeek-V2 and V3 configs, with each optional key
(mscale pairs, an explicit attention_factor, truncate, no original context) on families that did not ship it;
two such models give transformers' logits."""
import pytest
import torch
import transformers as hf
from transformers.modeling_rope_utils import _compute_yarn_parameters

from syntorch.checkpoints import load_checkpoint
from syntorch.hf_format import hf_config_to_model_config
from syntorch.models.layers import rope_frequencies
from syntorch.models.yarn import yarn_attention_factor
from tests.models import test_deepseek
from tests.models import test_llama

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=4.0, beta_slow=0.5)


def qwen3(**scaling):
    return hf.Qwen3Config(rope_theta=100.0, head_dim=16, rope_scaling={**BASE, **scaling}, **test_llama.COMMON)


def deepseek_v3(**scaling):
    return hf.DeepseekV3Config(n_group=4, topk_group=2, rope_scaling={**BASE, **scaling}, **test_deepseek.COMMON)


CASES = {
    "qwen3": lambda: qwen3(),
    "qwen3 mscale pair": lambda: qwen3(mscale=0.7, mscale_all_dim=1.0),
    "qwen3 no original context": lambda: qwen3(original_max_position_embeddings=None, factor=8.0),
    "gpt-oss attention_factor": lambda: hf.GptOssConfig(
        head_dim=8, rope_theta=100.0, rope_scaling={**BASE, "truncate": False, "attention_factor": 1.3},
        **test_llama.COMMON),
    "v3 mscale pair": lambda: deepseek_v3(mscale=1.0, mscale_all_dim=0.8, truncate=False),
    "v3 attention_factor": lambda: deepseek_v3(attention_factor=2.0, mscale_all_dim=0.8),
    "v2 old 'type' key, one mscale": lambda: hf.DeepseekV2Config(
        rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4, "mscale": 0.707},
        **test_deepseek.COMMON),
}


@pytest.mark.parametrize("case", CASES)
def test_frequencies_and_gain_equal_transformers(case):
    config = CASES[case]()
    inv_freq, gain = _compute_yarn_parameters(config, "cpu")
    c = hf_config_to_model_config(config.to_dict())
    assert torch.allclose(rope_frequencies(c), inv_freq, rtol=1e-6, atol=0)
    assert yarn_attention_factor(c) == pytest.approx(gain, rel=1e-12)
    assert inv_freq.min() < inv_freq.max() / 4  # not all one: the case covers scaled and kept pairs


@pytest.mark.parametrize("config,model", [(CASES["qwen3 mscale pair"], hf.Qwen3ForCausalLM),
                                          (CASES["v3 attention_factor"], hf.DeepseekV3ForCausalLM)])
def test_logits_match_transformers(config, model, tmp_path):
    reference = test_deepseek.randomized(model(config()))
    reference.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path)[1]
    with torch.no_grad():
        assert (ours(test_llama.ids()) - reference(test_llama.ids()).logits).abs().max().item() <= 1e-5
