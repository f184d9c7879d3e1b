"""Masked-token prediction, what an encoder (BERT) does at inference: one forward pass over the prompt (phase
"encode"), then the most likely tokens at the masked positions, as HuggingFace's fill-mask pipeline computes
them (softmax over the vocabulary, top k). The decoder counterpart is generate.py.

Which positions: those holding the mask token. A prompt without one (random ids) is predicted at every
position -- what the MLM head computes for each token anyway -- and the result says so (`masked` False).
Works on `meta` symbolically: the positions come from the prompt's known ids, the selection, softmax and
top-k are traced, and no values exist to report.
"""
import contextlib
import time
from dataclasses import dataclass

import torch

from syntorch.errors import UserError
from syntorch.generate import check_context

PHASE = "encode"  # not "prefill": there is no KV cache to fill and no decode after it
TOP = 5  # predictions per position, as the fill-mask pipeline's default top_k


@dataclass
class MaskedPrediction:
    """positions: per prompt row, the positions predicted. top_ids / top_probs: per row, per position, the TOP
    most likely token ids (best first) and their probabilities; None on `meta`, where no values exist."""
    positions: list[list[int]]
    masked: bool  # False: the prompt held no mask token, so every position was predicted
    top_ids: list[list[list[int]]] | None
    top_probs: list[list[list[float]]] | None
    encode_s: float


def predict_masked(model, prompt: torch.Tensor, mask_token_id: int, top: int = TOP,
                   phase_scope=None, lengths: list[int] | None = None) -> MaskedPrediction:
    """The `top` most likely tokens at each masked position of `prompt` ([B, T] ids on CPU: the positions are
    read from them, on every device). `phase_scope(name)`, if given, is entered around the pass (a tracer
    labels its ops with it). Under tensor parallelism the head's logits are gathered, so every rank predicts
    the same tokens. `lengths`: prompts of different lengths, right-padded as HuggingFace pads for BERT: row b's
    first lengths[b] positions are its own, the others are masked out of attention and never predicted."""
    device = next(model.parameters()).device
    _check_prompt(model.config, prompt, device)
    real = torch.ones(prompt.shape, dtype=torch.bool) if lengths is None else \
        torch.arange(prompt.shape[1])[None, :] < torch.tensor(lengths)[:, None]  # [B, T]
    rows, cols = ((prompt == mask_token_id) & real).nonzero(as_tuple=True)
    masked = len(rows) > 0
    if not masked:  # every position of every row, in order
        rows, cols = real.nonzero(as_tuple=True)
    inputs = {} if real.all() else {"attention_mask": real.long().to(device)}
    vocab = model.config.vocab_size
    begin = time.perf_counter()
    with torch.inference_mode(), (phase_scope or _no_scope)(PHASE):
        # a vocab-parallel head may pad the vocabulary; padding ids must never be predicted
        logits = model(prompt.to(device), **inputs)[rows.to(device), cols.to(device), :vocab].float()  # [N, V]
        probs, ids = logits.softmax(-1).topk(min(top, vocab))  # [N, top]
        if device.type != "meta":
            probs, ids = probs.cpu(), ids.cpu()
    encode_s = time.perf_counter() - begin
    positions = _per_row(rows, cols.tolist(), prompt.shape[0])
    if device.type == "meta":
        return MaskedPrediction(positions, masked, None, None, encode_s)
    return MaskedPrediction(positions, masked, _per_row(rows, ids.tolist(), prompt.shape[0]),
                            _per_row(rows, probs.tolist(), prompt.shape[0]), encode_s)


def _no_scope(_phase: str):
    return contextlib.nullcontext()


def _per_row(rows: torch.Tensor, values: list, batch: int) -> list[list]:
    """values (one per predicted position, rows ascending) split into one list per prompt row."""
    out = [[] for _ in range(batch)]
    for row, value in zip(rows.tolist(), values):
        out[row].append(value)
    return out


def _check_prompt(config, prompt: torch.Tensor, device) -> None:
    if config.causal:
        raise UserError(f"{config.name} is a decoder: it generates tokens (syntorch.generate), it has no MLM head")
    if prompt.dim() != 2 or prompt.shape[1] == 0 or prompt.dtype != torch.long or prompt.is_meta:
        raise UserError(f"the prompt must be a [batch, tokens] LongTensor of known ids with at least one token, "
                        f"got {prompt.dtype} of shape {list(prompt.shape)} on {prompt.device}")
    check_context(config, prompt.shape[1], 0, device)
