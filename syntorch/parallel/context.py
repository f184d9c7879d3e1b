"""Context parallelism: each rank of a CP group holds part of every sequence, and attention reads all of it.

The sequence is cut into 2 * cp chunks and CP rank i holds chunks i and 2 * cp - 1 - i: under a causal mask
a late chunk attends to many keys and an early one to few, so pairing them gives every rank the same work
(Megatron-LM's and Llama 3's load balancing). Everything but attention is per token and runs on the rank's
own tokens unchanged. Attention all-gathers K and V across the CP group before it reads them and
reduce-scatters their gradients in backward (the all-gather form of Llama 3, section 3.3.2: K/V are small
next to Q under GQA, and one collective per layer overlaps less but is simpler than a ring); the ring form
(K/V passed round the group, attention accumulated per step) is not offered.

Nothing in a model knows of CP. The plan
- puts a `GatheredKV` in each attention's `kv_gather` hook (models/layers.Attention.keys_values: this rank's
  K/V in, the keys and values attention reads out), so every family built on Attention works (MLA gathers
  its latent and rotary key); a layer that gathers keeps no KV cache (CP here splits training sequences);
- gives the model explicit per-token `positions` (embeddings, rotary) and a causal `mask` built from the
  global positions of the local queries and of the gathered keys, so a key is attended iff it comes
  no later than the query in the whole sequence;
- takes each micro-batch's tokens and targets at the rank's positions.
Each rank's loss is the mean over its tokens; all ranks hold as many, so averaging gradients over DP x CP
(plans.py: the grad group) gives the whole sequence's mean, as Megatron does.
"""
import torch
import torch.nn as nn

from syntorch.errors import UserError
from syntorch.models.causal import causal_pairs
from syntorch.models.layers import Attention
from syntorch.parallel import distributed as comm


def check_cp(cp: int, seq: int, tp: int = 1, sp: bool = False) -> None:
    if cp > 1 and seq % (2 * cp):
        raise UserError(f"--cp {cp} cuts the sequence into 2 * cp = {2 * cp} equal chunks; --seq {seq} does not "
                        f"divide by {2 * cp}")
    if cp > 1 and sp and (seq // cp) % tp:
        raise UserError(f"--sp splits each CP rank's {seq // cp} tokens over --tp {tp}; make seq / cp divide by tp")


def chunk_positions(seq: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions of CP rank `cp_rank`'s tokens: chunks cp_rank and 2 * cp - 1 - cp_rank of the sequence."""
    size = seq // (2 * cp)
    starts = (cp_rank * size, (2 * cp - 1 - cp_rank) * size)
    return torch.cat([torch.arange(s, s + size, device=device) for s in starts])


class GatheredKV(nn.Module):
    """Attention's kv_gather: this rank's K and V [B, H, T/cp, D] -> the whole sequence's [B, H, T, D], in
    CP-rank order (so key j's position is `ContextSplit.key_positions[j]`); gradients reduce-scattered."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, k: torch.Tensor, v: torch.Tensor):
        return comm.gather_from_sp(k, 2, self.group), comm.gather_from_sp(v, 2, self.group)


class ContextSplit:
    """One CP rank's share of every micro-batch: its token positions, and the causal mask over the gathered
    keys. Made once per run; the same for every micro-batch and layer."""

    def __init__(self, seq: int, cp: int, cp_rank: int, device):
        self.positions = chunk_positions(seq, cp, cp_rank, device)
        key_positions = torch.cat([chunk_positions(seq, cp, r, device) for r in range(cp)])
        self.mask = key_positions[None, :] <= self.positions[:, None]  # [T/cp, T], True = attend
        # the pairs it keeps, for the tracer's attention FLOPs (meta has no values): each chunk's queries attend
        # every key up to their own position
        size, chunks = seq // (2 * cp), (cp_rank, 2 * cp - 1 - cp_rank)
        self.mask.attended_pairs = sum(causal_pairs(size, seq, chunk * size) for chunk in chunks)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens (or targets) of a [B, T] batch."""
        return x.index_select(1, self.positions)

    def inputs(self) -> dict:
        """The model's positions and mask for this rank's tokens."""
        return {"positions": self.positions, "mask": self.mask}


def apply_cp(model: nn.Module, group) -> None:
    """Every attention of `model` reads K/V gathered across `group`."""
    for module in model.modules():
        if isinstance(module, Attention):
            if module.kv_cache is not None:
                raise UserError("context parallelism splits training sequences; this model holds KV caches (it is "
                                "generating): reset its caches first")
            module.kv_gather = GatheredKV(group)
