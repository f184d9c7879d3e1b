"""The KV cache the model owns (models/kv_cache.py): setup, beam reorder, a micro-batch's rows and reset, each
against a reference that keeps no such state: a fresh cache prefilled with the rows as they should end up, or
the whole batch run at once."""
import pytest
import torch
from conftest import tiny_config

from syntorch.models import build_model

B, T = 4, 6
CONFIGS = {"gpt2": tiny_config("gpt2"),  # one K/V per head
           "deepseek": tiny_config("deepseek-v2-lite", n_head=4, d_head=24, rotary_dim=8, v_head_dim=12,
                                   kv_lora_rank=16, n_experts=0, d_ff=64)}  # MLA: the latent and the rotary key


@pytest.fixture(params=list(CONFIGS))
def model(request):
    return build_model(CONFIGS[request.param])


def caches(model):
    return [block.attn.kv_cache for block in model.layers.values()]


def snapshot(model):
    return [(c.k.clone(), c.v.clone()) for c in caches(model)]


def prefilled(model, tokens):
    """The model with caches holding `tokens` [B, T], and the logits of that prefill."""
    model.setup_caches(tokens.shape[0], T + 1)
    return model(tokens)


def test_setup_allocates_each_layers_cache_and_reset_removes_it():
    model = build_model(CONFIGS["gpt2"])
    model.setup_caches(3, 10, torch.float16)
    assert all(c.k.shape == c.v.shape == (3, 4, 10, 16) and c.k.dtype == torch.float16 for c in caches(model))
    mla = build_model(CONFIGS["deepseek"])
    mla.setup_caches(3, 10)  # the model's dtype
    assert all((c.k.shape, c.v.shape, c.k.dtype) == ((3, 1, 10, 16), (3, 1, 10, 8), torch.float32) for c in caches(mla))
    model.reset_caches()
    assert caches(model) == [None, None]


@torch.inference_mode()
def test_reorder_moves_each_row_where_its_beam_came_from(model):
    tokens = torch.randint(0, 128, (B, T + 1))
    order = torch.tensor([2, 2, 0, 3])
    prefilled(model, tokens[:, :T])
    before = snapshot(model)
    model.reorder_caches(order)
    assert all(c.k.equal(k) for c, (k, _) in zip(caches(model), before))  # moved only when a layer runs
    step = model(tokens[order, T:], start=T)
    for cache, (k, v) in zip(caches(model), before):
        assert cache.k[:, :, :T].equal(k[order, :, :T]) and cache.v[:, :, :T].equal(v[order, :, :T])
        assert cache.order is None  # applied once
    prefilled(model, tokens[order, :T])  # reference: the reordered prompts prefilled afresh
    torch.testing.assert_close(step, model(tokens[order, T:], start=T))


@torch.inference_mode()
def test_micro_batch_rows_compute_what_the_whole_batch_does(model):
    """Prefill and a reordered decode step in two micro-batches of two rows (a row's beams stay in its
    micro-batch, as a pipeline keeps them) equal the whole batch at once."""
    tokens = torch.randint(0, 128, (B, T + 1))
    order = torch.tensor([1, 1, 3, 2])
    prefilled(model, tokens[:, :T])
    model.reorder_caches(order)
    whole = model(tokens[order, T:], start=T)
    want = snapshot(model)

    model.setup_caches(B, T + 1)
    halves = (slice(0, 2), slice(2, 4))
    for rows in halves:
        with model.cache_rows(rows):
            model(tokens[rows, :T])
    model.reorder_caches(order)
    parts = []
    for rows in halves:
        with model.cache_rows(rows):
            assert all(c.rows == rows for c in caches(model))
            parts.append(model(tokens[order][rows, T:], start=T))
        assert all(c.rows is None for c in caches(model))
        assert all((c.order is None) == (rows is halves[-1]) for c in caches(model))  # pending until the last
    torch.testing.assert_close(torch.cat(parts), whole)
    for cache, (k, v) in zip(caches(model), want):
        torch.testing.assert_close((cache.k, cache.v), (k, v))
