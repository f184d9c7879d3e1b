"""The one-process reference that real multi-rank training steps are checked against: the global batch every
rank takes its part of, and one step of the whole model on it."""
import torch
import torch.nn.functional as F

from syntorch.models import build_model


def global_batch(config, plan):
    """dp * microbatches * micro_batch_size rows of (tokens, next tokens), the same in every process."""
    tokens = torch.randint(0, config.vocab_size, (plan.dp * plan.microbatches * plan.micro_batch_size, plan.seq + 1),
                           generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def microbatches(config, plan):
    """The global batch (one data-parallel replica's) cut into the plan's micro-batches of (tokens, targets)."""
    x, y = global_batch(config, plan)
    b = plan.micro_batch_size
    return [(x[i:i + b], y[i:i + b]) for i in range(0, len(x), b)]


def reference_step(config, plan):
    """The same step in one process: mean loss over the global batch, its (clipped) gradients, one AdamW step.
    Returns (loss, gradients, updated parameters) by name."""
    torch.manual_seed(0)
    model = build_model(config, "cpu").train()
    x, y = global_batch(config, plan)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    if plan.clip_grad:  # clipped by the global norm, as the step (parallel/clip.py)
        torch.nn.utils.clip_grad_norm_(model.parameters(), plan.clip_grad)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=plan.lr, foreach=True).step()
    return loss.item(), grads, {n: p.detach() for n, p in model.named_parameters()}
