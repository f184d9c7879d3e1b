import json

import pytest
import torch

from syntorch.config import REGISTRY, get_config, load_model_config
from syntorch.errors import UserError
from syntorch.models import build_model


def param_count(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,expected_millions", [
    ("gpt2", 124.4), ("gpt3-125m", 125.2), ("gpt3-175b", 174_604), ("gptj-6b", 6_050.9), ("bert-base-uncased", 109.5),
])
def test_registry_parameter_counts(name, expected_millions):
    # meta build: no memory, so even 175B is counted here
    model = build_model(get_config(name), device="meta")
    assert param_count(model) / 1e6 == pytest.approx(expected_millions, rel=2e-3)
    assert next(model.parameters()).device.type == "meta"


def test_gpt3_table():
    c = get_config("gpt3-175b")
    assert (c.n_layer, c.d_model, c.n_head, c.d_head, c.d_ff, c.n_positions) == (96, 12288, 96, 128, 49152, 2048)
    assert get_config("gpt3-13b").d_model == 5120
    assert len([n for n in REGISTRY if n.startswith("gpt3")]) == 8


def test_unknown_model():
    with pytest.raises(UserError, match="unknown model 'gpt4'"):
        get_config("gpt4")


def test_model_config_overrides_base(tmp_path):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"base": "gpt3-125m", "n_layer": 2}))
    c = load_model_config(f)
    assert c.n_layer == 2 and c.d_model == 768 and c.d_ff == 3072


def test_model_config_defines_new_model(tmp_path):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"name": "mine", "arch": "gpt", "n_layer": 1, "d_model": 32, "n_head": 2,
                             "vocab_size": 10, "n_positions": 16}))
    c = load_model_config(f)
    assert c.d_head == 16 and c.d_ff == 128
    assert build_model(c)(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 10)


@pytest.mark.parametrize("content,message", [
    ({"name": "x", "arch": "gpt"}, "missing field"),
    ({"base": "gpt2", "n_layers": 3}, "unknown field"),
    ({"base": "gpt2", "n_layer": "3"}, "must be int"),
    ({"base": "gpt2", "n_layer": 0}, "positive integer"),
    ({"base": "gpt2", "arch": "rnn"}, "arch must be"),
])
def test_model_config_errors(tmp_path, content, message):
    f = tmp_path / "m.json"
    f.write_text(json.dumps(content))
    with pytest.raises(UserError, match=message):
        load_model_config(f)


def test_model_config_not_json(tmp_path):
    f = tmp_path / "m.json"
    f.write_text("{nope")
    with pytest.raises(UserError, match="not valid JSON"):
        load_model_config(f)
    with pytest.raises(UserError, match="not found"):
        load_model_config(tmp_path / "missing.json")
