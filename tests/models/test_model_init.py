"""Random initialisation: GPT-2's scheme for the GPT family (residual projections scaled by depth), BERT's; none on meta."""
import math
import subprocess
import sys

import pytest
from conftest import tiny_config

from syntorch.models import build_model


def _std(p) -> float:
    return p.detach().float().std().item()


@pytest.mark.parametrize("base", ["gpt2", "gptj-6b"])
def test_gpt_residual_projections_are_scaled_by_depth(base):
    model = build_model(tiny_config(base, n_layer=8, d_model=128, d_ff=512))
    scaled = 0.02 / math.sqrt(2 * 8)  # 0.005
    for block in model.layers.values():
        assert _std(block.attn.proj.weight) == pytest.approx(scaled, rel=0.05)
        assert _std(block.mlp.fc2.weight) == pytest.approx(scaled, rel=0.05)
        assert _std(block.attn.qkv.weight) == pytest.approx(0.02, rel=0.05)
        assert _std(block.mlp.fc1.weight) == pytest.approx(0.02, rel=0.05)
    assert _std(model.tok_emb.weight) == pytest.approx(0.02, rel=0.05)


def test_bert_projections_are_not_scaled():
    model = build_model(tiny_config("bert-base-uncased", n_layer=8, d_model=128, d_ff=512))
    for layer in model.layers.values():
        assert _std(layer.attn.proj.weight) == pytest.approx(0.02, rel=0.05)
        assert _std(layer.mlp.fc2.weight) == pytest.approx(0.02, rel=0.05)


def test_a_meta_build_skips_torch_init_and_its_compiler_imports():
    # torch.nn.init's fills on meta run Python reference kernels that import torch._dynamo (~1.5 s); a
    # symbolic model has no values to fill. A fresh process, so nothing else imported it first.
    code = ("import sys, torch; from syntorch.config import get_config; from syntorch.models import build_model; "
            "m = build_model(get_config('gpt3-175b'), 'meta', torch.bfloat16); "
            "print(m.tok_emb.weight.shape, m.tok_emb.weight.device, m.layers['95'].mlp.fc1.weight.dtype, "
            "'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["torch.Size([50257,", "12288])", "meta", "torch.bfloat16", "False"]
