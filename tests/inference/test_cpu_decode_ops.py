"""A CPU decode step of GPT-2 runs GPT-2's kernels and nothing else (issue 24: each small op costs a few
microseconds once the weights streamed past have evicted the caches, bench/cpu_decode.py). The reference is the
block's structure (Radford et al. 2019, nanoGPT's Block): per layer two LayerNorms, four matrix products (fused
q/k/v, projection, the MLP's two), one attention over the cache, one GELU, two residual adds, and the new key
and value written into the preallocated cache in place; outside the layers the two embedding lookups and their
sum, the final LayerNorm, the head and the argmax. A decode step replayed from its trace (decode_capture.py) runs
the same kernels."""
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_config
from syntorch.decode_capture import CapturedForward
from syntorch.generate import LocalForward, Sampling, generate
from syntorch.models import build_model

VIEWS = {"aten.view", "aten.slice", "aten.transpose", "aten.split_with_sizes", "aten.reshape", "aten.select",
         "aten.unsqueeze", "aten.expand", "aten.t", "aten.as_strided", "aten._unsafe_view", "aten.detach",
         "aten.size"}  # a traced step reads sizes through an op: no kernel either


class OpCount(TorchDispatchMode):
    """Counts the ops on tensors with at least one dimension (a traced step also does arithmetic on sizes, as
    0-dim tensors; an op without tensor arguments, such as arange, counts), or with `sizes` only those."""

    def __init__(self, sizes: bool = False):
        super().__init__()
        self.sizes = sizes
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if self.sizes == bool(tensors and not any(t.dim() for t in tensors)):
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def decode_step_ops(n_layer: int, captured: bool = False, sizes: bool = False) -> Counter:
    """The non-view ops of one greedy decode step (cache length 10) of a tiny GPT-2 with n_layer layers, eager
    or replayed from the trace of the step before; with `sizes`, its arithmetic on sizes instead."""
    model = build_model(tiny_config("gpt2", n_layer=n_layer))
    forward = CapturedForward(16, LocalForward())
    with torch.inference_mode():
        model.setup_caches(1, 16)
        model(torch.zeros(1, 8, dtype=torch.long))
        token = torch.zeros(1, 1, dtype=torch.long)
        forward.logits(model, token, 8, {})  # traced as it runs
        with OpCount(sizes) as count:
            if captured:
                forward.logits(model, token, 9, {}).argmax(-1)
            else:
                model(token, start=9, last_only=True)[:, -1].argmax(-1)
    return Counter({op: n for op, n in count.ops.items() if op not in VIEWS | {"aten.item"}})


def test_a_decode_step_runs_the_blocks_kernels_and_writes_the_cache_in_place():
    per_layer = {"aten.layer_norm": 2, "aten.linear": 4, "aten.scaled_dot_product_attention": 1, "aten.gelu": 1,
                 "aten.add": 2, "aten.copy_": 2}
    outside = {"aten.embedding": 2, "aten.arange": 1, "aten.add": 1, "aten.layer_norm": 1, "aten.linear": 1,
               "aten.argmax": 1}
    for n_layer in (1, 3):
        expected = Counter(outside)
        for op, n in per_layer.items():
            expected[op] += n * n_layer
        assert decode_step_ops(n_layer) == expected  # no cat, clone or contiguous copy of the cache or q/k/v


def test_a_captured_decode_step_runs_the_same_kernels():
    for n_layer in (1, 3):
        assert decode_step_ops(n_layer, captured=True) == decode_step_ops(n_layer)


def test_a_captured_layer_computes_only_its_cache_end_and_its_head_count_from_sizes():
    """Each op on a size is a kernel call in the captured step: a layer needs the end of its cache slots (one
    add) and its heads per q/k/v (a third of the qkv heads: one division), nothing more."""
    one, three = decode_step_ops(1, captured=True, sizes=True), decode_step_ops(3, captured=True, sizes=True)
    three.subtract(one)
    assert +three == Counter({"aten.add": 2, "aten.floor_divide": 2})


def test_the_lean_step_still_generates_what_a_full_recomputation_does():
    model = build_model(tiny_config("gpt2"))
    prompt = torch.randint(0, 128, (1, 5))
    tokens = generate(model, prompt, 6, Sampling(temperature=0)).tokens[0]
    with torch.inference_mode():  # no cache: every step recomputes the whole sequence
        ids = prompt
        for _ in range(6):
            ids = torch.cat((ids, model(ids)[:, -1:].argmax(-1)), 1)
    assert tokens == ids[0].tolist()
