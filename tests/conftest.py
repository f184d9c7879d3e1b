import dataclasses

import pytest
import torch

from syntorch.config import get_config


def tiny_config(base: str = "gpt2", **overrides):
    """A registry config shrunk to test size (2 layers, d_model 64, 4 heads, vocab 128)."""
    small = dict(n_layer=2, d_model=64, n_head=4, d_head=16, d_ff=256, vocab_size=128, n_positions=64)
    if get_config(base).pos == "rotary":
        small["rotary_dim"] = 8
    return dataclasses.replace(get_config(base), name=f"tiny-{base}", **{**small, **overrides})


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and OpenMP threads crawl when the cores are busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def in_turn(*calls) -> None:
    """A rank's entry making several checks in turn, each a (function, args): one launch of ranks serves them all
    (starting the ranks costs more than a tiny model's check)."""
    for function, args in calls:
        function(*args)
