"""The KV cache, and the methods by which a decoder owns it (gpt-fast's `setup_caches`): allocation, a beam
search's reorder, a micro-batch's rows and reset, all here. Plain PyTorch.

Each attention layer holds its cache as the child module `kv_cache` (so traces and state name its buffers
`layers.{i}.attn.kv_cache.k`) and only calls `update`; the model attaches, reorders, narrows and removes the
caches of the layers it holds (a pipeline stage: its own) through `DecoderCaches`, which GPT inherits.
"""
import contextlib

import torch
import torch.nn as nn


class KVCache(nn.Module):
    """A preallocated cache: decode writes one position in place, never concatenates. `k` and `v` are
    [B, H, S, D] (MLA keeps its latent in `k` and its shared rotary key in `v`: one "head" of its own widths)."""

    def __init__(self, k_shape: tuple, v_shape: tuple, dtype, device):
        super().__init__()
        self.register_buffer("k", torch.zeros(k_shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(v_shape, dtype=dtype, device=device), persistent=False)
        self.order: torch.Tensor | None = None  # a beam reorder pending (DecoderCaches.reorder_caches)
        self.rows: slice | None = None  # the rows one micro-batch uses (DecoderCaches.cache_rows); None: all

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor):
        # k, v: [b, H, T, D] of the rows in use, at slots start..start+T; returns their cache up to start+T
        keys, values = self._in_use(self.k), self._in_use(self.v)
        if self.order is not None:
            self._follow_beams(keys, values)
        end = start + k.shape[2]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def _in_use(self, buf: torch.Tensor) -> torch.Tensor:
        return buf if self.rows is None else buf[self.rows]

    def _follow_beams(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Row b of the rows in use becomes row order[b]: here, when the layer runs, so the copy is part of
        the layer's work in a trace. A row's beams share a micro-batch, so each one's rows reorder alone."""
        rows = self.rows
        index = self.order if rows is None else self.order[rows] - rows.start
        keys.copy_(keys.index_select(0, index))
        values.copy_(values.index_select(0, index))
        if rows is None or rows.stop >= self.k.shape[0]:  # micro-batches run in row order: the last ends it
            self.order = None


class DecoderCaches:
    """The KV-cache methods of a decoder (a mixin of nn.Module) whose blocks, in the ModuleDict `layers`,
    each have an attention `attn` with `new_cache` and a `kv_cache` slot."""

    def setup_caches(self, batch: int, max_seq: int, dtype: torch.dtype | None = None) -> None:
        """An empty cache for `batch` rows of up to `max_seq` positions in every attention layer held here, of
        `dtype` (default: the model's float dtype; a weight may be stored int8, syntorch/quant.py)."""
        dtype = dtype or next(p.dtype for p in self.parameters() if p.is_floating_point())
        for attn in self._attentions():
            assert attn.kv_gather is None, "a layer whose K/V are gathered from other ranks keeps no KV cache"
            attn.kv_cache = attn.new_cache(batch, max_seq, dtype)

    def reset_caches(self) -> None:
        """Remove the caches (their memory goes with them)."""
        for attn in self._attentions():
            attn.kv_cache = None

    def reorder_caches(self, order: torch.Tensor) -> None:
        """Beam search: cache row b becomes the old row order[b] in every layer, when the layer next runs."""
        for cache in self._caches():
            cache.order = order

    @contextlib.contextmanager
    def cache_rows(self, rows: slice):
        """Inside, every layer reads and writes only cache rows `rows` (a micro-batch of the whole batch)."""
        caches = self._caches()
        for cache in caches:
            cache.rows = rows
        try:
            yield
        finally:
            for cache in caches:
                cache.rows = None

    def _attentions(self) -> list[nn.Module]:
        return [block.attn for block in self.layers.values()]

    def _caches(self) -> list[KVCache]:
        return [attn.kv_cache for attn in self._attentions() if attn.kv_cache is not None]
