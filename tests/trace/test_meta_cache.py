"""MetaCache: memoized meta kernels give the same tensors, and the same training traces, as running them."""
import contextlib

import pytest
import torch
from conftest import tiny_config

from syntorch.parallel.plans import TrainPlan
from syntorch.trace import training
from syntorch.trace.meta_cache import MetaCache


def test_rebuilt_results_match_and_aliasing_ops_run():
    x = torch.empty(4, 6, device="meta").t()  # non-contiguous: strides are part of the key
    with MetaCache():
        first, again = x * 2, x * 2
        view = x.transpose(0, 1)
        inplace = x.mul_(3)
    assert (again.shape, again.stride(), again.dtype) == (first.shape, first.stride(), first.dtype)
    assert again.untyped_storage()._cdata != first.untyped_storage()._cdata  # a fresh tensor each time
    assert view.untyped_storage()._cdata == x.untyped_storage()._cdata and inplace is x


def test_in_place_ops_given_again_return_their_argument_and_those_changing_it_run():
    with MetaCache():
        x, y = torch.empty(3, 4, device="meta"), torch.empty(3, 4, device="meta")
        assert x.add_(y) is x and x.add_(y) is x  # the second from the cache
        flipped = [torch.empty(2, 3, device="meta").t_() for _ in range(2)]  # changes its argument: run each time
        cpu = [torch.zeros(3).fill_(value) for value in (1.0, 2.0)]  # writes data: run each time
    assert [t.shape for t in flipped] == [(3, 2), (3, 2)]
    assert [t.tolist() for t in cpu] == [[1.0] * 3, [2.0] * 3]


@pytest.mark.parametrize("base", ["gpt2", "gptj-6b", "bert-base-uncased"])
def test_stage_traces_equal_running_every_meta_kernel(monkeypatch, base):
    config = tiny_config(base, n_layer=4, vocab_size=200)
    plan = TrainPlan(dp=2, tp=2, pp=2, sp=base != "bert-base-uncased", zero=2, bucket_mb=0.02, microbatches=2,
                     seq=16)
    cached = [training.trace_stage(config, plan, s, replicate=False) for s in range(2)]
    monkeypatch.setattr(training, "MetaCache", contextlib.nullcontext)
    for stage, graph in enumerate(cached):
        ran = training.trace_stage(config, plan, stage, replicate=False)
        assert list(graph.nodes(data=True)) == list(ran.nodes(data=True))
        assert list(graph.edges(data=True)) == list(ran.edges(data=True))
