"""The training loss over a vocabulary split across the TP group, as Megatron and torchtitan compute it.

Without it each rank would all-gather the logits ([s, b, V], 210 MB per micro-batch for GPT-3 at TP 8) and run
the softmax over the whole vocabulary. Megatron's `_VocabParallelCrossEntropy` (megatron/core/tensor_parallel/
cross_entropy.py) and torchtitan's loss parallel keep the logits sharded and all-reduce three [s·b] tensors:
the row max (MAX), the target's logit (SUM; the rank holding the target gives it, the others 0) and the sum of
exponentials (SUM). Backward needs no collective of its own: the gradient of the local logits is
softmax - onehot on the local shard, and the head's f (or SP gather) sums the input's partial gradients.

Unlike Megatron, the padded vocabulary rows (padded to a multiple of 128·tp) get no probability: their logits
are masked to -inf, so the loss and gradients equal one process's over the real vocabulary.

    model.loss = loss_module(model)             # nn.CrossEntropyLoss without a vocab-parallel head
    with sharded_logits(model):
        logits = model(x)                       # [B, T, V_pad/tp] under TP
    loss = model.loss(logits.flatten(0, 1).float(), targets.flatten())
"""
import contextlib

import torch
import torch.nn as nn

from syntorch.parallel import distributed as comm
from syntorch.parallel.tensor import VocabParallelHead

IGNORE_INDEX = -100  # torch's cross_entropy default: targets that add nothing to the loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss [N] from this rank's logits [N, V_pad/tp] (columns vocab_start..) and target ids [N]."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start: int, group):
        local = logits.shape[-1]
        logits_max = comm.all_reduce(logits.amax(-1), "max", group)  # [N]
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (target < vocab_start) | (target >= vocab_start + local)  # another rank holds the target
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0)
        target_logit = comm.all_reduce(target_logit, "sum", group)
        sum_exp = comm.all_reduce(shifted.exp_().sum(-1), "sum", group)
        softmax = shifted.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        # d loss / d logits = softmax - onehot(target), on this rank's columns; in place, as Megatron does
        softmax, local_target, outside = ctx.saved_tensors
        onehot = (~outside).to(softmax.dtype).unsqueeze(-1)  # 1 where this rank holds the target
        grad_logits = softmax.scatter_add_(-1, local_target.unsqueeze(-1), -onehot)
        return grad_logits.mul_(grad.unsqueeze(-1)), None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """Mean cross-entropy over the targets that are not IGNORE_INDEX, from vocabulary-sharded logits."""

    def __init__(self, head: VocabParallelHead):
        super().__init__()
        tp = head.tp
        self.group, self.vocab_size = tp.group, head.vocab_size
        self.local = head.weight.shape[0]
        self.vocab_start = tp.rank * self.local
        self.padded = self.local * tp.size > self.vocab_size

    def forward(self, logits, targets):  # logits [N, V_pad/tp], targets [N]
        if self.padded:  # every rank masks (most have no padding), so all ranks run the same ops
            columns = torch.arange(self.vocab_start, self.vocab_start + self.local, device=logits.device)
            logits = logits.masked_fill(columns >= self.vocab_size, float("-inf"))
        per_token = _VocabParallelCrossEntropy.apply(logits, targets, self.vocab_start, self.group)
        kept = targets != IGNORE_INDEX  # Megatron's loss_mask: sum(losses * mask) / sum(mask)
        return (per_token * kept).sum() / kept.sum()


def loss_module(model: nn.Module) -> nn.Module:
    """The last stage's loss: vocabulary-parallel under TP, else torch's cross-entropy."""
    head = getattr(model, "lm_head", None)
    return VocabParallelCrossEntropy(head) if isinstance(head, VocabParallelHead) else nn.CrossEntropyLoss()


@contextlib.contextmanager
def sharded_logits(model: nn.Module):
    """Inside, a vocab-parallel head returns this rank's logits [B, T, V_pad/tp] instead of gathering them."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, VocabParallelHead):
        yield
        return
    head.gather = False
    try:
        yield
    finally:
        head.gather = True
