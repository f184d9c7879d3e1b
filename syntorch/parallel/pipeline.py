"""Pipeline parallelism: contiguous layer stages, schedules as data, activations sent between stages.

A stage is the plain model with the parts it does not own removed (layers are a ModuleDict, so the kept
ones keep their names `layers.{i}`): the first stage keeps the embeddings, the last the final norm, the head
and the loss. The model's own forward skips what its stage lacks (as torchtitan's does); `stage_forward` adds
only what the model must not know: the whole sequence's length on stages that receive a split stream, the loss.

Schedules are lists of steps ("F" or "B", micro-batch, chunk), the order one stage runs them:
- GPipe: every forward, then every backward (Huang et al. 2019).
- 1F1B: `pp - stage - 1` warm-up forwards, then one forward and one backward alternating, then the
  remaining backwards (Narayanan et al. 2021, PipeDream-Flush), so at most `pp - stage` micro-batches
  of activations are alive on a stage.
- Interleaved 1F1B (`virtual` V > 1): each stage holds V non-contiguous chunks of layers and runs them as
  Megatron-LM does (`interleaved_schedule`); the bubble shrinks by V, more activations are alive.
Activations go forward and their gradients backward as send/recv pairs over a 2-rank process group of
neighbouring stages (and, interleaved, from the last stage to the first), tagged by micro-batch, chunk
boundary and direction so every send meets its recv. Sends do not wait for their recv (`send_forward`).

Scatter/gather (Megatron-LM's default with TP and without sequence parallel; `--no-scatter-gather-tensors-in-
pipeline` turns it off there, `--no_scatter_gather` here): the stream, and its gradient, are the same on every
TP rank, so each TP rank sends only its 1/t of the flattened tensor to its peer of the next (previous) stage,
and the receiving stage all-gathers the parts over TP (Narayanan et al. 2021, section 4.1; Megatron's
`split_tensor_into_1d_equal_chunks` and `gather_split_1d_tensor`). Without TP, under sequence parallel (the
stream is split already) or when t does not divide the tensor, the whole tensor is sent.
"""
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.models import build_model, module_view, on_meta
from syntorch.parallel import distributed as comm
from syntorch.parallel.layout import Layout, chunk_ranges, chunk_sizes
from syntorch.parallel.loss import loss_module, sharded_logits

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


def stage_chunks(n_layer: int, pp: int, virtual: int = 1, layout: Layout = Layout()) -> list[tuple[range, ...]]:
    """Each stage's chunks of layers. With `virtual` V > 1 the layers are cut into pp·V equal chunks and
    stage s holds chunks s, s + pp, s + 2pp, ... (Megatron's virtual pipeline); else its one contiguous range.
    An uneven `layout` (Megatron-Core's first/last-stage counts or embedding/loss accounting) sizes them
    as layout.py says, dealt in the same order."""
    if not layout.even:
        return chunk_ranges(chunk_sizes(n_layer, pp, virtual, layout))
    if virtual == 1:
        return [(layers,) for layers in stage_layers(n_layer, pp)]
    if n_layer % pp or (n_layer // pp) % virtual:
        raise UserError(f"--virtual_stages {virtual} must divide the layers per stage: {n_layer} layers over "
                        f"--pp {pp} is {n_layer / pp:g} per stage; pick a V (and pp) that divide it evenly")
    size = n_layer // (pp * virtual)
    return [tuple(range((c * pp + s) * size, (c * pp + s + 1) * size) for c in range(virtual)) for s in range(pp)]


def check_schedule(kind: str) -> None:
    if kind not in SCHEDULES:
        raise UserError(f"unknown --schedule {kind!r}; choose one of: {', '.join(SCHEDULES)}")


def schedule(kind: str, stage: int, pp: int, microbatches: int, virtual: int = 1) -> list[tuple[str, int, int]]:
    """The (step, micro-batch, chunk) order one stage runs: ("F", 0, 0), ("F", 1, 0), ..., ("B", 0, 0), ...

    `chunk` is which of the stage's `virtual` chunks of layers the step runs (0 without interleaving)."""
    check_schedule(kind)
    if kind == "gpipe":  # chunk by chunk forward, the reverse backward
        return ([("F", m, c) for c in range(virtual) for m in range(microbatches)] +
                [("B", m, c) for c in reversed(range(virtual)) for m in range(microbatches)])
    if virtual > 1:
        return interleaved_schedule(stage, pp, microbatches, virtual)
    warmup = min(pp - stage - 1, microbatches)
    steps = [("F", m, 0) for m in range(warmup)]
    for i in range(microbatches - warmup):
        steps += [("F", warmup + i, 0), ("B", i, 0)]
    return steps + [("B", m, 0) for m in range(microbatches - warmup, microbatches)]


def interleaved_schedule(stage: int, pp: int, microbatches: int, virtual: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B as Megatron-LM runs it (Narayanan et al. 2021, section 2.2): the stage's M·V
    (micro-batch, chunk) steps go in groups of pp micro-batches per chunk, chunk 0 first forward and last
    first backward; warm-up is (pp - stage - 1)·2 + (V - 1)·pp forwards (all of them when M == pp), then
    one forward and one backward alternate, then the remaining backwards."""
    check_interleaving(pp, microbatches, virtual)
    total = microbatches * virtual

    def step(kind: str, k: int) -> tuple[str, int, int]:
        group, within = divmod(k, pp * virtual)
        chunk = within // pp
        return kind, group * pp + within % pp, chunk if kind == "F" else virtual - 1 - chunk

    warmup = total if microbatches == pp else min((pp - stage - 1) * 2 + (virtual - 1) * pp, total)
    steps = [step("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [step("F", warmup + k), step("B", k)]
    return steps + [step("B", k) for k in range(total - warmup, total)]


def check_interleaving(pp: int, microbatches: int, virtual: int) -> None:
    if virtual < 1:
        raise UserError(f"--virtual_stages must be at least 1, got {virtual}")
    if virtual > 1 and pp < 2:
        raise UserError(f"--virtual_stages {virtual} interleaves pipeline stages; it needs --pp > 1")
    if virtual > 1 and microbatches % pp:
        raise UserError(f"--microbatches {microbatches} must be a multiple of --pp {pp} with --virtual_stages "
                        f"{virtual} (Megatron's interleaved schedule runs micro-batches in groups of pp)")


@dataclass(frozen=True)
class Stage:
    index: int
    count: int
    layers: range | tuple[int, ...]  # every layer the stage holds, in order
    chunks: tuple[range, ...] = ()  # under interleaving, its V chunks of layers

    @property
    def virtual(self) -> int:
        return max(len(self.chunks), 1)

    def holds_input(self, chunk: int) -> bool:
        """Whether the chunk takes the tokens (the first chunk of the first stage) rather than a stream."""
        return self.first and chunk == 0

    def holds_loss(self, chunk: int) -> bool:
        return self.last and chunk == self.virtual - 1

    def in_boundary(self, chunk: int) -> int:
        """Which chunk boundary the chunk's input crosses (see `tag`): from the previous stage's same chunk,
        or on the first stage from the last stage's previous chunk."""
        return chunk if not self.first else chunk - 1

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
        model.layers = nn.ModuleDict({str(i): block(config, i) for i in stage.layers}).to(dtype)
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
        model.loss = loss_module(model)  # a module, so its ops are attributed to `loss`; vocab-parallel under TP
    return model


def chunk_view(model: nn.Module, stage: Stage, chunk: int) -> nn.Module:
    """The stage's model as chunk `chunk` runs it: the same modules and parameters, only the chunk's layers,
    the embeddings only on the input chunk and the head only on the loss chunk. Without interleaving, the model."""
    if stage.virtual == 1:
        return model
    view = module_view(model)
    view.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in stage.chunks[chunk]})
    for name in FIRST_STAGE if not stage.holds_input(chunk) else ():
        if hasattr(view, name):
            setattr(view, name, None)
    for name in LAST_STAGE if not stage.holds_loss(chunk) else ():
        if hasattr(view, name):
            setattr(view, name, None)
    return view


def activation_shape(config: ModelConfig, micro_batch_size: int, seq: int, tp: int, sp: bool) -> tuple:
    """What one stage sends the next: the residual stream [B, T, d], split along T under sequence parallel."""
    return (micro_batch_size, seq // tp if sp else seq, config.d_model)


def stage_forward(model: nn.Module, x: torch.Tensor, targets: torch.Tensor | None = None,
                  seq_len: int | None = None, **inputs) -> torch.Tensor:
    """One micro-batch through a stage: token ids [B, T] on the first stage, else the residual stream
    received from the previous stage; `seq_len`: the whole sequence's length when that stream is split along
    it (sequence parallel): GPT's positions (rotary tables) come from it. `inputs` are the model's other
    arguments (BERT's attention_mask, which every stage needs, and token_type_ids). Returns the loss on the
    last stage (the logits without targets), else the stream to send on. The model runs whatever part it holds."""
    if seq_len is not None and model.config.arch == "gpt":
        inputs = {**inputs, "seq_len": seq_len}
    if targets is None:
        return model(x, **inputs)
    with sharded_logits(model):  # under TP the loss reads each rank's vocabulary shard (loss.py)
        out = model(x, **inputs)
    return model.loss(out.flatten(0, 1).float(), targets.flatten())


def tag(microbatch: int, backward: bool, boundary: int = 0, virtual: int = 1) -> int:
    """Activations of micro-batch m crossing chunk boundary c (c: the sending chunk, 0 without interleaving)
    travel with tag 2(mV + c), their gradients with 2(mV + c) + 1: one tag per message on every link."""
    return 2 * (microbatch * virtual + boundary) + int(backward)


def wait_sends(works: list) -> None:
    """Wait for the send works send_forward/send_backward returned (None: nothing was sent)."""
    for work in works:
        if work is not None:
            work.wait()


def _scattered(x: torch.Tensor, split) -> bool:
    """Is x sent in parts over the TP group `split` (None: no scatter/gather)?"""
    return split is not None and x.numel() % comm.world_size(split) == 0


def _part(x: torch.Tensor, split) -> torch.Tensor:
    """What this rank sends of x: its 1/t of the flattened tensor, or all of x."""
    return comm.own_chunk(x.reshape(-1), 0, split) if _scattered(x, split) else x


def _recv_whole(buffer: torch.Tensor, src: int, group, tag: int, split) -> torch.Tensor:
    """Receives into `buffer` (the whole tensor's shape) from `src`: all of it, or this rank's 1/t of it and
    then the other TP ranks' parts gathered over `split`."""
    if not _scattered(buffer, split):
        return comm.recv(buffer, src, group, tag)
    part = comm.recv(buffer.new_empty(buffer.numel() // comm.world_size(split)), src, group, tag)
    return comm.all_gather(part, group=split).view(buffer.shape)


def send_forward(x: torch.Tensor, links, microbatch: int, boundary: int = 0, virtual: int = 1, split=None):
    """Returns the send's work, or None: the caller waits on it at the end of the schedule, so a stage never
    waits for its peer to reach the matching recv (with interleaving, the peer may first send it something).
    `split`: the TP group the stream is scattered over (see the module docstring), or None."""
    if links.next is not None:
        return comm.isend(_part(x.detach(), split), links.next_rank, links.next,
                          tag(microbatch, False, boundary, virtual))


def recv_forward(shape, dtype, device, links, microbatch: int, boundary: int = 0, virtual: int = 1,
                 split=None) -> torch.Tensor:
    x = torch.empty(shape, dtype=dtype, device=device)
    return _recv_whole(x, links.prev_rank, links.prev, tag(microbatch, False, boundary, virtual),
                       split).requires_grad_(torch.is_grad_enabled())


def send_backward(grad: torch.Tensor, links, microbatch: int, boundary: int = 0, virtual: int = 1, split=None):
    """Returns the send's work, or None (see send_forward)."""
    if links.prev is not None:
        return comm.isend(_part(grad, split), links.prev_rank, links.prev, tag(microbatch, True, boundary, virtual))


def recv_backward(like: torch.Tensor, links, microbatch: int, boundary: int = 0, virtual: int = 1,
                  split=None) -> torch.Tensor:
    return _recv_whole(torch.empty_like(like), links.next_rank, links.next, tag(microbatch, True, boundary, virtual),
                       split)
