"""GPT.forward's explicit `positions` and `mask`: what ragged batches and context-parallel chunks build on."""
import pytest
import torch

from syntorch.models import build_model
from tests.conftest import tiny_config


@pytest.mark.parametrize("base", ["gpt2", "gptj-6b"])
def test_explicit_positions_and_mask_equal_the_defaults(base):
    model = build_model(tiny_config(base), device="cpu").eval()
    ids = torch.randint(0, 128, (2, 7))
    positions = torch.arange(7).expand(2, 7)  # per row
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    with torch.no_grad():
        default = model(ids)
        explicit = model(ids, positions=positions, mask=causal[None, None])
    torch.testing.assert_close(explicit, default)


@pytest.mark.parametrize("base", ["gpt2", "gptj-6b"])
def test_a_shifted_row_matches_its_unshifted_run(base):
    """A row whose tokens sit at cache slots 3.. but at positions 0.. (left padding, masked out) gives the
    logits the same tokens give alone."""
    model = build_model(tiny_config(base), device="cpu").eval()
    ids = torch.randint(0, 128, (1, 5))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    positions = torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4]])
    keep = torch.tensor([False] * 3 + [True] * 5)
    mask = torch.ones(8, 8, dtype=torch.bool).tril() & keep[None, :]
    mask |= torch.eye(8, dtype=torch.bool)  # a pad row attends to itself, so its softmax is defined
    with torch.no_grad():
        alone = model(ids)
        shifted = model(padded, positions=positions, mask=mask[None, None])
    torch.testing.assert_close(shifted[:, 3:], alone, atol=1e-5, rtol=1e-5)
