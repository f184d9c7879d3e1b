"""Llama, Mistral, Qwen2 and Mixtral against transformers: HF folders load as they are (safetensors, sharded
index) with the same logits, greedy and beam tokens; saved ones load back into transformers."""
import json

import pytest
import torch
import transformers as hf

from syntorch.checkpoints import load_checkpoint, save_checkpoint
from syntorch.hf_format import hf_config_to_model_config
from syntorch.errors import UserError
from syntorch.generate import Sampling, generate
from syntorch.models import build_model
from tests.conftest import tiny_config

GREEDY = Sampling(temperature=0)
VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0,
              eos_token_id=0, pad_token_id=VOCAB - 1)


pytestmark = pytest.mark.usefixtures("one_thread")


def make(family: str):
    """A tiny model of each family that exercises its own features: Llama 3.1's scaled rotary over a short
    original context (so scaled, blended and kept frequencies all occur), Mistral's window shorter than the
    prompts, Qwen2's q/k/v biases, Mixtral's router over 4 experts."""
    if family == "llama":
        scaling = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=16)
        return hf.LlamaForCausalLM(hf.LlamaConfig(rope_theta=500.0, rope_scaling=scaling, **COMMON))
    if family == "mistral":
        return hf.MistralForCausalLM(hf.MistralConfig(sliding_window=5, **COMMON))
    if family == "qwen2":
        return hf.Qwen2ForCausalLM(hf.Qwen2Config(rope_theta=1e4, **COMMON))
    return hf.MixtralForCausalLM(hf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                                                  **COMMON))


FAMILIES = ["llama", "mistral", "qwen2", "mixtral"]


def randomized(model):
    """Wide random weights (norms and biases too), so attention is far from uniform and a wrong rotary pairing,
    window or routing moves logits well beyond the tolerance."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(family, HF model, folder it saved, our model loaded from it); the Llama folder is sharded."""
    model = randomized(make(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, max_shard_size="100KB" if request.param == "llama" else "1GB")
    return request.param, model, folder, load_checkpoint(folder)[1]


def ids(batch=2, length=12, seed=1):
    return torch.randint(1, VOCAB - 1, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_logits_match_transformers(pair):
    family, model, folder, ours = pair
    if family == "llama":
        assert (folder / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        ref = model(ids()).logits
        mine = ours(ids())
    assert ref.abs().max() > 1
    assert (mine - ref).abs().max().item() <= 1e-4


def hf_generate(model, prompt, new_tokens, **kwargs):
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=VOCAB - 1, eos_token_id=None, **kwargs).tolist()


@pytest.mark.parametrize("beams", [1, 3])
def test_greedy_and_beam_tokens_match_transformers(pair, beams):
    """Decode steps continue the rotary positions (and slide Mistral's window) past the 8-token prompt."""
    _, model, _, ours = pair
    prompt = ids(length=8, seed=2)
    expected = hf_generate(model, prompt, 10, num_beams=beams)
    assert generate(ours, prompt, 10, GREEDY, beam_width=beams).tokens == expected


def test_config_mapping_and_kv_cache_holds_kv_heads(pair):
    family, _, folder, ours = pair
    c = ours.config
    assert (c.n_head, c.kv_heads, c.d_head, c.norm, c.gated_mlp, c.rotary_style) == (8, 2, 8, "rmsnorm", True, "half")
    assert c.qkv_bias == (family == "qwen2") and c.sliding_window == (5 if family == "mistral" else 0)
    assert c.n_experts == (4 if family == "mixtral" else 0)
    assert (c.rope_scaling, c.rope_original_positions) == (("llama3", 16) if family == "llama" else ("", 8192))
    ours.setup_caches(2, 20)
    assert ours.layers["0"].attn.kv_cache.k.shape == (2, 2, 20, 8)  # K/V heads only
    ours.reset_caches()


def test_save_round_trip_through_transformers(pair, tmp_path):
    family, model, _, ours = pair
    save_checkpoint(ours, tmp_path / "out")
    reloaded = hf.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded) is type(model)
    with torch.no_grad():
        assert (reloaded(ids()).logits - model(ids()).logits).abs().max().item() <= 1e-4


def test_left_padded_row_matches_its_unpadded_run():
    """Per-row positions with rotate-half rotary, GQA and the sliding window: a row at cache slots 3.. but
    positions 0.. gives the logits its tokens give alone."""
    model = build_model(tiny_config("mistral-7b", n_head=8, n_kv_head=2, d_head=8, rotary_dim=0, sliding_window=4))
    tokens = torch.randint(0, 128, (1, 7))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), tokens], 1)
    positions = torch.tensor([[0, 0, 0] + list(range(7))])
    keep = torch.tensor([False] * 3 + [True] * 7)
    mask = (torch.ones(10, 10, dtype=torch.bool).tril() & keep[None, :]) | torch.eye(10, dtype=torch.bool)
    with torch.no_grad():
        alone = model(tokens)
        shifted = model(padded, positions=positions, mask=mask[None, None])
    torch.testing.assert_close(shifted[:, 3:], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]},
     r"model_type 'gemma' \(architectures \['GemmaForCausalLM'\]\) is not supported"),
    ({"num_key_value_heads": 3}, r"n_kv_head \(3\) must divide n_head \(8\)"),
    ({"num_experts_per_tok": 5}, r"moe_top_k must be between 1 and n_experts \(4\), got 5"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_scaling type 'dynamic' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
])
def test_bad_configs_are_one_line(change, message):
    config = {**make("mixtral").config.to_dict(), **change}
    with pytest.raises(UserError, match=message) as e:
        hf_config_to_model_config(json.loads(json.dumps(config)))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name,params", [
    # the parameter counts HuggingFace shows for each checkpoint's safetensors (Mixtral-8x22B: the 32768-token
    # vocabulary of mistralai/Mixtral-8x22B-v0.1)
    ("llama-2-7b", 6_738_415_616), ("llama-2-13b", 13_015_864_320), ("llama-2-70b", 68_976_648_192),
    ("llama-3-8b", 8_030_261_248), ("llama-3-70b", 70_553_706_496), ("llama-3.1-405b", 405_853_388_800),
    ("mistral-7b", 7_241_732_096), ("qwen2-7b", 7_615_616_512), ("mixtral-8x7b", 46_702_792_704),
    ("mixtral-8x22b", 140_630_071_296),
])
def test_registry_parameter_counts(name, params):
    from syntorch.config import get_config
    model = build_model(get_config(name), device="meta")
    assert sum(p.numel() for p in model.parameters()) == params


def test_deepseek_style_moe_from_model_config(tmp_path):
    """Shared experts and many small experts, expressed in a --model_config file."""
    from syntorch.config import load_model_config
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"base": "mixtral-8x7b", "n_experts": 64, "moe_top_k": 6, "d_ff_expert": 1408,
                                "n_shared_experts": 2, "moe_renormalize": False}))
    c = load_model_config(path)
    mlp = build_model(c, device="meta").layers["0"].mlp
    assert len(mlp.experts) == 64 and mlp.top_k == 6 and not mlp.renormalize
    per_layer = sum(p.numel() for p in mlp.parameters())
    assert per_layer == 4096 * 64 + 64 * 3 * 4096 * 1408 + 3 * 4096 * 2 * 1408


def test_tied_head_and_own_head_dim(tmp_path):
    """Small Qwen2/Llama checkpoints tie the head to the embedding, and some set head_dim apart from
    hidden_size / heads."""
    torch.manual_seed(0)
    model = hf.Qwen2ForCausalLM(hf.Qwen2Config(**{**COMMON, "tie_word_embeddings": True, "head_dim": 16})).eval()
    model.save_pretrained(tmp_path)
    config, ours = load_checkpoint(tmp_path)
    assert config.tied_head and config.d_head == 16 and ours.lm_head.weight is ours.tok_emb.weight
    with torch.no_grad():
        assert (ours(ids()) - model(ids()).logits).abs().max().item() <= 1e-4
