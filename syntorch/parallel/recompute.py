"""Activation recomputation as a plan step (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models"): the model file stays plain; this wraps what a finished model runs.

- "full": each transformer block keeps only its input; its whole forward runs again in backward
  (Megatron's `--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`).
- "selective": only the attention core -- scaled_dot_product_attention: QK^T, softmax, dropout, attention
  over V -- runs again in backward (Megatron's `--recompute-granularity selective`); the GEMMs' inputs
  stay saved.

Both use torch's reentrant checkpoint: its forward runs without autograd and its backward reruns the
function and backpropagates through it, so every recomputed op runs (and is traced) inside the backward
pass, whatever the function saves. The non-reentrant form recomputes only when a saved tensor is unpacked,
and stops after the last one, so it would skip the block's final ops and a fused attention op whose
autograd function keeps its own tensors.
"""
import contextlib
import functools
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from syntorch.errors import UserError
from syntorch.models.layers import Attention

RECOMPUTE = ("none", "selective", "full")


def check_recompute(recompute: str, mode: str = "train") -> None:
    if recompute not in RECOMPUTE:
        raise UserError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if recompute != "none" and mode != "train":
        raise UserError(f"--recompute {recompute} recomputes activations in backward, which inference has not; "
                        "drop --recompute")


def apply_recompute(model: nn.Module, recompute: str) -> None:
    """Wraps `model`'s blocks (full) or attention cores (selective) in place; "none" leaves it as it is."""
    check_recompute(recompute)
    if recompute == "full":
        for block in getattr(model, "layers", {}).values():
            # the block's forward held weakly: set on the block, a strong one is a cycle that keeps every block
            # of a search task's probe until a full collection
            block.forward = functools.partial(_checkpointed_method, weakref.WeakMethod(block.forward))
    elif recompute == "selective":
        for module in model.modules():
            if isinstance(module, Attention):
                _recompute_core(module)


def _checkpointed_method(method: weakref.WeakMethod, *args):
    return _checkpointed(method(), *args)


def _checkpointed(function, *args):
    """function(*args), run again in backward under the torch-function modes it first ran under (autograd's
    backward keeps dispatch modes but not function modes, so a recomputed op would otherwise run otherwise)."""
    modes = torch.overrides._get_current_function_mode_stack()

    def rerun(*inputs):
        with contextlib.ExitStack() as stack:
            active = torch.overrides._get_current_function_mode_stack()
            for mode in modes if not active else ():
                stack.enter_context(mode)
            return function(*inputs)

    # our models have no dropout, so the RNG state need not be replayed (and meta has none to save)
    return checkpoint(rerun, *args, use_reentrant=True, preserve_rng_state=False)


def _recompute_core(attention: Attention) -> None:
    """While `attention` runs, its scaled_dot_product_attention call is checkpointed (a function mode,
    entered and left by the module's own hooks, so the model's forward is untouched)."""
    mode = _CheckpointAttention()

    def enter(_module, _args):
        mode.__enter__()  # a pre-hook's return value would replace the module's arguments

    attention.register_forward_pre_hook(enter)
    attention.register_forward_hook(lambda _module, _args, _out: mode.__exit__(None, None, None), always_call=True)


class _CheckpointAttention(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and torch.is_grad_enabled():
            return _checkpointed(functools.partial(func, **kwargs), *args)
        return func(*args, **kwargs)
