"""Attention's remembered layouts (attention.py with meta_cache.remember/rebuilt): a training trace whose sdpa
forwards and backwards are rebuilt from the first layer's equals one that runs sdpa's math path every time,
node for node and edge for edge."""
import pytest
from conftest import tiny_config

from syntorch.parallel.plans import TrainPlan
from syntorch.trace import meta_cache, training


@pytest.mark.parametrize("base, options", [
    ("gpt2", dict(tp=2, pp=2, sp=True)),  # is_causal
    ("llama-2-7b", dict(cp=2, pp=2)),  # grouped K/V heads, context parallelism's boolean masks
])
def test_rebuilt_attention_equals_running_it(monkeypatch, base, options):
    config = tiny_config(base, n_layer=4, vocab_size=200, **({"n_kv_head": 2} if base != "gpt2" else {}))
    plan = TrainPlan(dp=2, microbatches=2, seq=16, **options)
    rebuilt, hits = meta_cache.rebuilt, []

    def counted(key):
        found = rebuilt(key)
        hits.append(found is not None)
        return found

    monkeypatch.setattr(meta_cache, "rebuilt", counted)
    remembered = training.trace_stage(config, plan, 0, replicate=False)
    assert sum(hits) >= len(hits) // 2  # every layer after the first, forward and backward
    monkeypatch.setattr(meta_cache, "rebuilt", lambda key: None)
    ran = training.trace_stage(config, plan, 0, replicate=False)
    assert list(remembered.nodes(data=True)) == list(ran.nodes(data=True))
    assert list(remembered.edges(data=True)) == list(ran.edges(data=True))
