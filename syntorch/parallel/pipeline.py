"""Pipeline parallelism: contiguous layer stages, schedules as data, activations sent between stages.

A stage is the plain model with the parts it does not own removed (layers are a ModuleDict, so the kept
ones keep their names `layers.{i}`): the first stage keeps the embeddings, the last the final norm, the head
and the loss. The model's own forward skips what its stage lacks (as torchtitan's does); `stage_forward` adds
only what the model must not know: the TP group's sequence state on stages without the embedding, the loss.

Schedules are lists of steps ("F" or "B", micro-batch), the order one stage runs them:
- GPipe: every forward, then every backward (Huang et al. 2019).
- 1F1B: `pp - stage - 1` warm-up forwards, then one forward and one backward alternating, then the
  remaining backwards (Narayanan et al. 2021, PipeDream-Flush), so at most `pp - stage` micro-batches
  of activations are alive on a stage.
Activations go forward and their gradients backward as send/recv pairs over a 2-rank process group of
neighbouring stages, tagged by micro-batch and direction so every send meets its recv.
"""
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.models import build_model, on_meta
from syntorch.parallel import comm

SCHEDULES = ("1f1b", "gpipe")
# what each family's first and last stage own, beside their layers
FIRST_STAGE = ("tok_emb", "pos_emb", "type_emb", "ln_emb")
LAST_STAGE = ("ln_f", "head_dense", "head_ln", "lm_head")


def stage_layers(n_layer: int, pp: int) -> list[range]:
    """Contiguous layer ranges, one per stage; the first `n_layer % pp` stages take one layer more."""
    if pp > n_layer:
        raise UserError(f"--pp {pp} is larger than the model's {n_layer} layers; each stage needs a layer")
    size, extra = divmod(n_layer, pp)
    bounds = [0]
    for s in range(pp):
        bounds.append(bounds[-1] + size + (s < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(pp)]


def check_schedule(kind: str) -> None:
    if kind not in SCHEDULES:
        raise UserError(f"unknown --schedule {kind!r}; choose one of: {', '.join(SCHEDULES)}")


def schedule(kind: str, stage: int, pp: int, microbatches: int) -> list[tuple[str, int]]:
    """The (step, micro-batch) order one stage runs: ("F", 0), ("F", 1), ..., ("B", 0), ..."""
    check_schedule(kind)
    if kind == "gpipe":
        return [("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]
    warmup = min(pp - stage - 1, microbatches)
    steps = [("F", m) for m in range(warmup)]
    for i in range(microbatches - warmup):
        steps += [("F", warmup + i), ("B", i)]
    return steps + [("B", m) for m in range(microbatches - warmup, microbatches)]


@dataclass(frozen=True)
class Stage:
    index: int
    count: int
    layers: range

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def build_stage_model(config: ModelConfig, stage: Stage, device="meta", dtype=torch.float32) -> nn.Module:
    """The model with the layers `stage` owns (and, for now, every embedding and head: split_stage drops them).

    On meta only those layers are built, so a 96-layer model costs what one stage holds; elsewhere the
    whole model is built and initialised as build_model does, so every stage has the single-process weights.
    """
    if torch.device(device).type != "meta":
        return build_model(config, device, dtype)
    model = build_model(dataclasses.replace(config, n_layer=1), "meta", dtype)
    block = type(model.layers["0"])
    with on_meta():
        model.layers = nn.ModuleDict({str(i): block(config) for i in stage.layers}).to(dtype)
    model.config = config
    return model


def split_stage(model: nn.Module, stage: Stage) -> nn.Module:
    """Drop in place what `stage` does not own; the first stage keeps the embeddings, the last the head."""
    for name in list(model.layers):
        if int(name) not in stage.layers:
            del model.layers[name]
    for name in FIRST_STAGE if not stage.first else ():
        if hasattr(model, name):
            setattr(model, name, None)
    for name in LAST_STAGE if not stage.last else ():
        if hasattr(model, name):
            setattr(model, name, None)
    if stage.last:
        model.loss = nn.CrossEntropyLoss()  # a module, so its ops are attributed to `loss`
    return model


def tp_group_of(model: nn.Module):
    """The TPGroup apply_tp shared among the model's parallel modules, or None without TP."""
    return next((m.tp for m in model.modules() if hasattr(m, "tp") and hasattr(m.tp, "seq_split")), None)


def activation_shape(config: ModelConfig, micro_batch_size: int, seq: int, tp: int, sp: bool) -> tuple:
    """What one stage sends the next: the residual stream [B, T, d], split along T under sequence parallel."""
    return (micro_batch_size, seq // tp if sp else seq, config.d_model)


def stage_forward(model: nn.Module, x: torch.Tensor, targets: torch.Tensor | None = None,
                  **inputs) -> torch.Tensor:
    """One micro-batch through a stage: token ids [B, T] on the first stage, else the residual stream
    received from the previous stage; `inputs` are the model's other arguments (BERT's attention_mask,
    which every stage needs, and token_type_ids). Returns the loss on the last stage (the logits without
    targets), else the stream to send on. The model runs whatever part it holds."""
    if model.tok_emb is None:
        inputs = {**inputs, **_received_stream(model, x)}
    out = model(x, **inputs)
    return out if targets is None else model.loss(out.flatten(0, 1).float(), targets.flatten())


def _received_stream(model: nn.Module, x: torch.Tensor) -> dict:
    """Before a stage without the embedding runs the stream [B, T', d] it received: set the TP group's
    sequence state for this forward (on the first stage the vocab-parallel embedding sets it; the model
    knows nothing of TP), and return what the model needs to know of the whole sequence: GPT's positions
    (rotary tables) come from its length, which a sequence-split stream does not show."""
    tp = tp_group_of(model)
    split = tp is not None and tp.sequence_parallel  # the plan checked that T divides by tp
    T = x.shape[1] * (tp.size if split else 1)
    if tp is not None:
        tp.seq_split, tp.seq_len = split, T
    return {"seq_len": T} if model.config.arch == "gpt" else {}


def tag(microbatch: int, backward: bool) -> int:
    """Activations of micro-batch m travel with tag 2m, their gradients with 2m + 1."""
    return 2 * microbatch + int(backward)


def send_forward(x: torch.Tensor, links, microbatch: int) -> None:
    if links.next is not None:
        comm.send(x.detach(), links.next_rank, links.next, tag(microbatch, False))


def recv_forward(shape, dtype, device, links, microbatch: int) -> torch.Tensor:
    x = torch.empty(shape, dtype=dtype, device=device)
    return comm.recv(x, links.prev_rank, links.prev, tag(microbatch, False)).requires_grad_(torch.is_grad_enabled())


def send_backward(grad: torch.Tensor, links, microbatch: int) -> None:
    if links.prev is not None:
        comm.send(grad, links.prev_rank, links.prev, tag(microbatch, True))


def recv_backward(like: torch.Tensor, links, microbatch: int) -> torch.Tensor:
    return comm.recv(torch.empty_like(like), links.next_rank, links.next, tag(microbatch, True))
