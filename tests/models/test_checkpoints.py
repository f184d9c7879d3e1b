"""HuggingFace checkpoints: parity with transformers on tiny random models, round trips, and bad input."""
import json
import shutil

import pytest
import torch
import transformers as hf
from safetensors.torch import load_file, save_file

import syntorch.checkpoints as ckpt
from syntorch.checkpoints import load_checkpoint, save_checkpoint
from syntorch.hf_format import hf_to_syntorch_state_dict
from syntorch.errors import UserError
from syntorch.models import build_model
from conftest import tiny_config

TINY = dict(vocab_size=128, n_positions=64)


def make_gpt2():
    return hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=2, n_embd=64, n_head=4, **TINY))


def make_gptj():  # rotary on 8 of the 16 dims of each head
    return hf.GPTJForCausalLM(hf.GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, **TINY))


def make_bert(cls=hf.BertForMaskedLM):
    return cls(hf.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                             vocab_size=128, max_position_embeddings=64))


MAKERS = {"gpt2": make_gpt2, "gptj": make_gptj, "bert": make_bert}


def randomized(model):
    """Large random values everywhere (LayerNorms and biases too): with HF's N(0, 0.02) init attention is
    nearly uniform and a swapped q/k or a missed transpose would hide under the 1e-4 tolerance."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (HF model, folder with model.safetensors, folder with pytorch_model.bin)."""
    torch.manual_seed(0)
    out = {}
    for family, make in MAKERS.items():
        model = randomized(make())
        root = tmp_path_factory.mktemp(family)
        model.save_pretrained(root / "st")
        model.save_pretrained(root / "bin", safe_serialization=False)
        out[family] = model, root / "st", root / "bin"
    return out


def inputs():
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 128, (2, 12), generator=g)
    mask = torch.ones_like(idx)
    mask[1, 7:] = 0  # the second sequence is padded
    types = torch.zeros_like(idx)
    types[:, 6:] = 1
    return idx, mask, types


@torch.no_grad()
def logits(model, family, from_hf):
    idx, mask, types = inputs()
    if family != "bert":
        return model(idx).logits if from_hf else model(idx)
    out = (model(idx, attention_mask=mask, token_type_ids=types).logits if from_hf
           else model(idx, token_type_ids=types, attention_mask=mask))
    return out[mask.bool()]  # padded positions are not compared


@pytest.mark.parametrize("fmt", ["st", "bin"])
@pytest.mark.parametrize("family", list(MAKERS))
def test_parity_with_transformers(saved, family, fmt):
    model, st, bin_ = saved[family]
    folder = st if fmt == "st" else bin_
    assert (folder / ("model.safetensors" if fmt == "st" else "pytorch_model.bin")).is_file()
    config, ours = load_checkpoint(folder)
    ref = logits(model, family, from_hf=True)
    assert ref.abs().max() > 1  # the comparison below is not between near-zero numbers
    assert (logits(ours, family, from_hf=False) - ref).abs().max().item() <= 1e-4
    assert config.arch == ("bert" if family == "bert" else "gpt")


def test_config_mapping(saved):
    gptj = load_checkpoint(saved["gptj"][1])[0]
    assert (gptj.pos, gptj.rotary_dim, gptj.d_head, gptj.parallel_residual, gptj.tied_head) == ("rotary", 8, 16, True, False)
    assert (gptj.head_bias, gptj.qkv_bias, gptj.proj_bias, gptj.activation) == (True, False, False, "gelu_tanh")
    bert = load_checkpoint(saved["bert"][1])[0]
    assert (bert.d_ff, bert.ln_eps, bert.activation, bert.type_vocab_size) == (256, 1e-12, "gelu", 2)
    full_rotary = ckpt.hf_config_to_model_config({**hf.GPTJConfig(n_embd=64, n_head=4).to_dict(), "rotary_dim": None})
    assert full_rotary.rotary_dim == 16


def test_parity_check_is_sensitive_and_dtype_applies(saved, tmp_path):
    """The parity test can fail: swapping q and k in a checkpoint moves the logits far beyond 1e-4."""
    model, st, _ = saved["gptj"]
    folder = tmp_path / "swapped"
    shutil.copytree(st, folder)
    sd = load_file(folder / "model.safetensors")
    q, k = "transformer.h.0.attn.q_proj.weight", "transformer.h.0.attn.k_proj.weight"
    sd[q], sd[k] = sd[k], sd[q]
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    assert (logits(load_checkpoint(folder)[1], "gptj", False) - logits(model, "gptj", True)).abs().max() > 1e-2
    half = load_checkpoint(st, dtype=torch.bfloat16)[1]
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("family", list(MAKERS))
def test_save_round_trip_through_transformers(saved, family, tmp_path):
    model, st, _ = saved[family]
    _, ours = load_checkpoint(st)
    save_checkpoint(ours, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".syntorch.json", "config.json", "model.safetensors"]
    modes = {(tmp_path / "out" / name).stat().st_mode & 0o777 for name in ("config.json", "model.safetensors")}
    assert len(modes) == 1 and modes.pop() & 0o044  # the weights readable as the config is (safetensors made 0600)
    auto = hf.AutoModelForMaskedLM if family == "bert" else hf.AutoModelForCausalLM
    reloaded = auto.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded) is type(model)
    assert (logits(reloaded, family, True) - logits(model, family, True)).abs().max().item() <= 1e-4
    _, again = load_checkpoint(tmp_path / "out")
    assert (logits(again, family, False) - logits(ours, family, False)).abs().max().item() == 0


def test_save_our_random_gpt3_shape_and_untied_gpt2(tmp_path):
    """Issue 7 saves models built from the registry; an untied GPT-2 keeps its own head."""
    for name, overrides in [("gpt3-125m", {}), ("gpt2", dict(tied_head=False))]:
        ours = build_model(tiny_config(name, **overrides))
        save_checkpoint(ours, tmp_path / name)
        reloaded = hf.AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        idx = inputs()[0]
        with torch.no_grad():
            assert (reloaded(idx).logits - ours(idx)).abs().max().item() <= 1e-4
        assert reloaded.config.tie_word_embeddings == (name == "gpt3-125m")


def test_bert_pretraining_checkpoint_and_base_model_keys(tmp_path):
    """BertForPreTraining (as bert-base-uncased is saved) carries a pooler and NSP head we drop; keys without the
    `bert.`/`transformer.` prefix and LayerNorm gamma/beta names (older checkpoints) map too."""
    torch.manual_seed(0)
    pre = randomized(make_bert(hf.BertForPreTraining))
    pre.save_pretrained(tmp_path / "pre")
    _, ours = load_checkpoint(tmp_path / "pre")
    idx = inputs()[0]
    with torch.no_grad():
        assert (ours(idx) - pre(idx).prediction_logits).abs().max().item() <= 1e-4
    gpt2 = randomized(make_gpt2())
    config = ckpt.hf_config_to_model_config(gpt2.config.to_dict())
    # as the original gpt2 checkpoint: a GPT2Model (no prefix, no head) with the causal-mask buffers
    base = {k.removeprefix("transformer."): v for k, v in gpt2.state_dict().items() if k != "lm_head.weight"}
    base.update({"h.0.attn.bias": torch.ones(1, 1, 64, 64), "h.0.attn.masked_bias": torch.tensor(-1e4)})
    state = hf_to_syntorch_state_dict(base, config)
    assert torch.equal(state["layers.1.mlp.fc1.weight"], gpt2.transformer.h[1].mlp.c_fc.weight.t())
    assert state["lm_head.weight"] is state["tok_emb.weight"]
    bert_sd = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in pre.state_dict().items()}
    state = hf_to_syntorch_state_dict(bert_sd, ckpt.hf_config_to_model_config(pre.config.to_dict()))
    assert torch.equal(state["layers.0.ln1.bias"], pre.bert.encoder.layer[0].attention.output.LayerNorm.bias)


def test_legacy_bin_format_and_mask_token_from_vocab(saved, tmp_path):
    """.bin files written before torch 1.6 are not zip archives and cannot be memory-mapped."""
    model, st, _ = saved["bert"]
    shutil.copy(st / "config.json", tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]) + "\n")
    config, ours = load_checkpoint(tmp_path)
    assert (logits(ours, "bert", False) - logits(model, "bert", True)).abs().max().item() <= 1e-4
    assert config.mask_token_id == 4


def test_sharded_checkpoint(saved, tmp_path):
    model, _, _ = saved["gpt2"]
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    _, ours = load_checkpoint(tmp_path)
    assert (logits(ours, "gpt2", False) - logits(model, "gpt2", True)).abs().max().item() <= 1e-4


def test_loading_builds_on_meta_and_assigns(saved, monkeypatch):
    """No randomly initialised model and no copy into it: the parameters ARE the converted tensors."""
    built, converted = [], {}
    real_build, real_convert = ckpt.build_model, ckpt.hf_to_syntorch_state_dict

    def spy_build(config, device="cpu", dtype=torch.float32):
        built.append(str(device))
        return real_build(config, device=device, dtype=dtype)

    def spy_convert(hf_state_dict, config):
        converted.update(real_convert(hf_state_dict, config))
        return converted

    monkeypatch.setattr(ckpt, "build_model", spy_build)
    monkeypatch.setattr(ckpt, "hf_to_syntorch_state_dict", spy_convert)
    _, model = load_checkpoint(saved["gpt2"][1])
    assert built and set(built) == {"meta"}
    params = dict(model.named_parameters(remove_duplicate=False))
    assert set(params) == set(converted)
    assert all(params[k].data_ptr() == converted[k].data_ptr() for k in params)
    assert model.lm_head.weight is model.tok_emb.weight


def one_line_error(match, fn, *args):
    with pytest.raises(UserError, match=match) as e:
        fn(*args)
    assert "\n" not in str(e.value)
    return str(e.value)


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **changes}))


def edit_weights(folder, fn):
    sd = load_file(folder / "model.safetensors")
    fn(sd)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def gpt2_copy(saved, tmp_path):
    shutil.copytree(saved["gpt2"][1], tmp_path / "c")
    return tmp_path / "c"


def test_missing_folder_config_and_weights(tmp_path, gpt2_copy):
    one_line_error("checkpoint folder not found", load_checkpoint, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    one_line_error("has no config.json", load_checkpoint, tmp_path / "empty")
    (gpt2_copy / "model.safetensors").unlink()
    one_line_error("no weights in .*model.safetensors or pytorch_model.bin", load_checkpoint, gpt2_copy)
    (gpt2_copy / "config.json").write_text("{not json")
    one_line_error("config.json is not valid JSON", load_checkpoint, gpt2_copy)


@pytest.mark.parametrize("fmt", ["st", "bin"])
def test_truncated_weights(saved, tmp_path, fmt):
    folder = tmp_path / fmt
    shutil.copytree(saved["bert"][1 if fmt == "st" else 2], folder)
    weights = folder / ("model.safetensors" if fmt == "st" else "pytorch_model.bin")
    weights.write_bytes(weights.read_bytes()[:5000])
    one_line_error(f"cannot read weights file .*{weights.name}.*corrupt or truncated", load_checkpoint, folder)


def test_bin_that_is_not_a_state_dict(saved, tmp_path):
    shutil.copy(saved["gpt2"][1] / "config.json", tmp_path)
    torch.save([torch.zeros(2)], tmp_path / "pytorch_model.bin")
    one_line_error("not a state dict of named tensors", load_checkpoint, tmp_path)


def test_missing_extra_and_misshaped_tensors(gpt2_copy):
    edit_weights(gpt2_copy, lambda sd: sd.pop("transformer.h.1.mlp.c_fc.bias"))
    one_line_error(r"lacks tensor\(s\) transformer.h.1.mlp.c_fc.bias", load_checkpoint, gpt2_copy)
    edit_weights(gpt2_copy, lambda sd: sd.update({"transformer.h.1.mlp.c_fc.bias": torch.zeros(256),
                                                  "score.weight": torch.zeros(2, 64)}))
    one_line_error(r"has tensor\(s\) score.weight that GPT2LMHeadModel does not", load_checkpoint, gpt2_copy)
    edit_weights(gpt2_copy, lambda sd: sd.pop("score.weight"))
    load_checkpoint(gpt2_copy)  # repaired
    edit_config(gpt2_copy, n_positions=32)
    one_line_error(r"transformer.wpe.weight has shape \[64, 64\] but config.json implies \[32, 64\]",
                   load_checkpoint, gpt2_copy)


@pytest.mark.parametrize("family,field,value", [
    ("gpt2", "scale_attn_by_inverse_layer_idx", True),
    ("gpt2", "scale_attn_weights", False),
    ("gpt2", "activation_function", "relu"),
    ("gptj", "activation_function", "silu"),
    ("bert", "position_embedding_type", "relative_key"),
    ("bert", "hidden_act", "gelu_new"),
    ("bert", "is_decoder", True),
    ("gpt2", "n_embd", "64"),
    ("gpt2", "model_type", "gemma"),  # llama loads since issue 16
])
def test_unsupported_config_fields(saved, tmp_path, family, field, value):
    shutil.copytree(saved[family][1], tmp_path / "c")
    edit_config(tmp_path / "c", **{field: value})
    one_line_error(field, load_checkpoint, tmp_path / "c")


def test_model_type_from_architectures_alone(saved, tmp_path):
    shutil.copytree(saved["gptj"][1], tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    del cfg["model_type"]
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(tmp_path / "c")[0].pos == "rotary"


def test_save_errors_leave_nothing(tmp_path):
    one_line_error("meta device", save_checkpoint, build_model(tiny_config("gpt2"), device="meta"), tmp_path / "m")
    odd = build_model(tiny_config("gpt2", parallel_residual=True))  # learned positions + parallel residual
    one_line_error("parallel_residual=True has no HuggingFace GPT2LMHeadModel equivalent", save_checkpoint, odd,
                   tmp_path / "odd")
    assert not any(tmp_path.iterdir())
