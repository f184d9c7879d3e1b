"""How long a device takes for the ops of a trace: which ops launch kernels (the software profile), and
each kernel's time from its shape and the device's achievable figures (hardware.py).

Kernel time = kernel_overhead_us + one of
- GEMM (mm, addmm, bmm, baddbmm): max(math, memory). Math: the output is cut into tiles of
  TILE_N columns and up to TILE_M rows (smaller for few rows, as cuBLAS picks narrow tiles for skinny
  GEMMs); each SM runs one tile at a time at `gemm_efficiency` of its share of peak, so the tiles run in
  ceil(tiles / sm_count) waves. Fewer tiles than SMs: split-K spreads them over sm_count // tiles slices
  of K, whose FP32 partial sums a second pass writes and reads back.
  Memory: the bytes the op reads and writes at `memory_efficiency` of the bandwidth.
- attention (the fused sdpa op): the attention kernel is a software choice (ATTENTION_KERNELS, `--attention`):
  flash (default; what PyTorch's SDPA, Transformer Engine/cuDNN, NeMo and torchtitan run since 2023): one
  FlashAttention-style kernel, max(math, memory), its math the op's FLOPs, which count only the (query, key)
  pairs a causal mask keeps (attention.py; flash kernels skip the masked blocks), at `attention_efficiency`.
  unfused (Megatron-LM 2022 and FasterTransformer's context attention, which the A100 calibration tables ran):
  a batched GEMM for QK^T, a softmax kernel and a batched GEMM over V over the whole score matrix, masked or
  not (so the dense FLOPs, from the shapes), the score matrix going through memory SCORE_PASSES times
  (forward: written, read and written by softmax, read; backward: dP written, P read for dV, softmax backward
  reads P and dP and writes dS, dS read twice). Under the eager profile that is PyTorch's math path
  (aten::_scaled_dot_product_attention_math), which adds a masked score matrix's mask as a kernel of its own
  (attn.add_(mask): the scores read and written once more); under the fused profile the mask and scale live
  in Megatron's fused softmax. Decode (one query) under the fused profile is one kernel either way
  (FasterTransformer's masked multi-head attention kernel).
- anything else: max(FLOPs at `gemm_efficiency` of peak, bytes at `memory_efficiency` of bandwidth).

Profiles (the same trace, other kernels):
- eager: one kernel per aten op, as PyTorch runs our traces; views and ops that only make metadata
  (NO_KERNEL) launch nothing. The host issues each kernel of a generation step (hw.host_overhead_us apiece),
  and a kernel starts no earlier than it is issued (cost.add_host_waits): short kernels run at the host's rate.
- fused: elementwise ops (FUSIBLE: bias and residual adds, activations, casts, copies) launch nothing of
  their own. Each joins a neighbouring kernel, as FasterTransformer and Megatron-LM fuse them: the kernel
  that just produced its input (a GEMM's epilogue: bias, GeLU, the KV-cache write), or else the next
  kernel that reads its output (add-bias-residual-layernorm after an all-reduce). Their traffic that does
  not cancel inside the fused kernel -- everything but the one input they share with it and their own
  output -- is added to that kernel's bytes. Elementwise ops with no such neighbour fuse among themselves.
  A cat that only lays out the chunks of a sequence-parallel all-gather or reduce-scatter is free
  (Megatron's [s, b, h] layout has them in place; ours, [b, s, h], needs the copy in eager).
"""
import math

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from syntorch.hardware import HardwareConfig
from syntorch.trace.attention import SDPA

PROFILES = ("eager", "fused")
ATTENTION_KERNELS = ("flash", "unfused")  # --attention (module docstring)
GEMMS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm"})  # _scaled_mm: FP8
ATTENTION = frozenset({SDPA, SDPA + "_backward"})
# ops that allocate or relabel a tensor without a kernel
NO_KERNEL = frozenset({"aten._unsafe_view", "aten.new_empty", "aten.empty", "aten.empty_like", "aten.detach",
                       "aten.alias", "aten.lift_fresh", "aten.scalar_tensor", "aten.empty_strided"})
FUSIBLE = frozenset({
    "aten.add", "aten.add_", "aten.sub", "aten.sub_", "aten.mul", "aten.mul_", "aten.div", "aten.div_",
    "aten.gelu", "aten.gelu_backward", "aten.silu", "aten.silu_backward", "aten.relu", "aten.threshold_backward",
    "aten.tanh", "aten.tanh_backward", "aten.pow", "aten.neg", "aten.rsqrt", "aten.exp", "aten.sigmoid",
    "aten.copy_", "aten._to_copy", "aten.clone", "aten.masked_fill", "aten.masked_fill_", "aten.where",
    "aten.fill_", "aten.zero_", "aten.addcmul", "aten.addcdiv", "aten.lerp", "aten.maximum",
})
TILE_M, TILE_N = 128, 128  # cuBLAS/CUTLASS's usual threadblock tile for large FP16/BF16 GEMMs on Ampere/Hopper
MIN_TILE_M = 16  # the tensor cores' MMA height (m16n8k16): the narrowest tile a skinny GEMM uses
SCORE_PASSES = {SDPA: 4, SDPA + "_backward": 7}


def compute_us(flops: int, nbytes: int, dtype: str, hw: HardwareConfig, kind: str = "gemm", launches: int = 1) -> float:
    """One kernel that is not a GEMM (`launches` of it for a multi-tensor op): its fixed cost per launch plus
    the slower of its math and its memory traffic."""
    return launches * hw.kernel_overhead_us + max(math_us(flops, dtype, hw, kind), memory_us(nbytes, hw))


def math_us(flops: float, dtype: str, hw: HardwareConfig, kind: str = "gemm") -> float:
    """At the fraction of peak `kind` reaches: "attention" for flash kernels (hw.attention_efficiency)."""
    return 1e6 * flops / (hw.peak_flops(dtype) * hw.math_efficiency(kind))


def memory_us(nbytes: float, hw: HardwareConfig) -> float:
    return 1e6 * nbytes / (hw.memory_bw_gb_s * 1e9 * hw.memory_efficiency)


def gemm_us(batch: int, m: int, n: int, k: int, nbytes: int, dtype: str, hw: HardwareConfig) -> float:
    """A [batch x] (m x k) @ (k x n) GEMM moving `nbytes`: tile and wave quantization over the SMs."""
    tile_m = min(TILE_M, max(MIN_TILE_M, 1 << max(0, m - 1).bit_length()))
    tiles = batch * math.ceil(m / tile_m) * math.ceil(n / TILE_N)
    waves = math.ceil(tiles / hw.sm_count) if tiles >= hw.sm_count else tiles / hw.sm_count
    padded_flops = waves * hw.sm_count * 2 * tile_m * TILE_N * k
    # split-K: each of the `splits` slices of K writes FP32 partial sums that a second pass reads and adds
    splits = hw.sm_count // tiles if tiles < hw.sm_count else 1
    reduction_us = memory_us(2 * splits * batch * m * n * 4, hw) if splits > 1 else 0.0
    return hw.kernel_overhead_us + max(math_us(padded_flops, dtype, hw), memory_us(nbytes, hw)) + reduction_us


def attention_us(name: str, flops: int, nbytes: int, q_shape, k_shape, dtype: str, hw: HardwareConfig,
                 profile: str, attention: str = "flash") -> float:
    """The fused sdpa op (forward or backward) as `attention` and `profile` run it (module docstring): the one
    place that decides between a flash kernel and the unfused core."""
    if attention == "flash" or (profile == "fused" and q_shape[-2] == 1):
        return compute_us(flops, nbytes, dtype, hw, "attention")
    # every score computed, masked or not (V's head size is Q's in every model here, so k stands for v)
    dense = sdpa_flop_count(q_shape, k_shape, k_shape) if name == SDPA else \
        sdpa_backward_flop_count(q_shape, q_shape, k_shape, k_shape)
    kernels = 3 if name == SDPA else 5  # GEMM, softmax, GEMM / two GEMMs, softmax backward, two GEMMs
    passes = SCORE_PASSES[name]
    if profile == "eager" and name == SDPA and flops < dense:  # the math path adds the causal mask on its own
        kernels, passes = kernels + 1, passes + 2
    scores = math.prod(q_shape[:-1]) * k_shape[-2]  # [B, H, Sq] x Sk, in the op's dtype (FP16 in Megatron's softmax)
    score_bytes = passes * scores * getattr(torch, dtype).itemsize
    return kernels * hw.kernel_overhead_us + math_us(dense, dtype, hw) + memory_us(nbytes + score_bytes, hw)


# Sorting and selecting along rows (the vocabulary, when sampling) are radix passes over them, each reading the
# data again, not the one pass their inputs and outputs suggest:
# - aten.sort: cub's segmented radix sort, which PyTorch's CUDA sort of a batch of rows and FasterTransformer's
#   top-p sampling (sampling_topp_kernels.cu: cub::DeviceSegmentedRadixSort::SortPairsDescending) both run:
#   ceil(key bits / SORT_RADIX_BITS) passes (cub device/dispatch/dispatch_radix_sort.cuh, Policy800:
#   SEGMENTED_RADIX_BITS 6 for keys wider than a byte), each reading the keys twice (its digit counts, then the
#   scatter) and their indices once, and writing both.
# - aten.topk: PyTorch's radix select (aten/src/ATen/native/cuda/TensorTopK.cu, mbtopk: RADIX_BITS 8): a pass
#   reading the input per SELECT_RADIX_BITS key bits, then gatherTopK reads it once more and writes the results.
SORT_RADIX_BITS = 6
SELECT_RADIX_BITS = 8
RADIX_OPS = frozenset({"aten.sort", "aten.topk"})


def radix_bytes(name: str, keys: int, key_bytes: int, index_bytes: int, written: int) -> int:
    """Memory traffic of aten.sort (keys with their int indices) or aten.topk (`written`: its outputs' bytes) over
    `keys` keys of `key_bytes` each (the comment above)."""
    if name == "aten.sort":
        return -(-8 * key_bytes // SORT_RADIX_BITS) * keys * (3 * key_bytes + 2 * index_bytes)
    return (-(-8 * key_bytes // SELECT_RADIX_BITS) + 1) * keys * key_bytes + written


def launches_kernel(data: dict) -> bool:
    return data["kind"] == "collective" or not (data.get("is_view") or data["name"] in NO_KERNEL)


def kernel_plan(graph, profile: str) -> dict[int, int]:
    """For each op: the bytes it adds to the kernel it runs in, or -1 when it runs in another op's kernel
    (it then costs nothing itself). Ops absent from the plan are their own kernel as traced."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; use one of {', '.join(PROFILES)}")
    plan = {} if profile == "eager" else _FusedPlan(graph).plan
    plan.update(optimizer_plan(graph, profile))
    return plan


# The optimizer step as launched (phase "optimizer"). torch's foreach ops and Megatron's (apex/TE) fused Adam
# both go through multi_tensor_apply: each launch takes up to MAX_TENSORS[depth] tensors of `depth` lists and
# MAX_BLOCKS chunks of CHUNK_ELEMENTS (torch's ATen/native/cuda/MultiTensorApply.cuh: kChunkSize 65536,
# depth_to_max_tensors, depth_to_max_blocks; apex's multi_tensor_apply.cuh has the same tables, Megatron calls
# it with chunk size 2048 * 32).
CHUNK_ELEMENTS = 65536
MAX_BLOCKS = 320
MAX_TENSORS = (110, 64, 48, 36, 30)  # by depth 1..5


def multi_tensor_launches(numels: list[int], depth: int) -> int:
    """Kernel launches of one multi_tensor_apply over tensors of `numels` elements in `depth` lists."""
    chunks = sum(-(-n // CHUNK_ELEMENTS) for n in numels)
    return max(1, -(-len(numels) // MAX_TENSORS[min(max(depth, 1), 5) - 1]), -(-chunks // MAX_BLOCKS))


def foreach_launches(graph, node) -> int:
    """A foreach op's launches: its lists (inputs, and outputs unless written in place) over its tensors."""
    nodes = graph.node_attrs
    outputs = list(graph.succs[node])
    numels = [math.prod(nodes[t]["shape"]) for t in outputs] or [0]
    in_place = all(e.get("arg") == -1 for e in graph.succs[node].values())
    depth = -(-(len(graph.preds[node]) + (0 if in_place else len(outputs))) // max(1, len(outputs)))
    return multi_tensor_launches(numels, depth)


def optimizer_plan(graph, profile: str) -> dict[int, int]:
    """The optimizer phase's kernels under `profile`:
    - both: torch's AdamW keeps its step counters as CPU scalars (unless capturable): their increment and
      `.item()` reads are host work, no device kernel;
    - eager: each foreach op its own kernels (torch's foreach AdamW, the gradient cast and clipping);
    - fused: the elementwise foreach work between two synchronisations (the gradient norm's all-reduce, a
      ZeRO all-gather) is one multi-tensor pass, as Megatron's fused Adam (apex / Transformer Engine
      FusedAdam with FP32 master weights) runs it: each tensor it reads from memory once, each piece of
      state it updates (parameters, master weights, moments) written once; the FP32 gradients, the clip
      factor's product and Adam's temporaries stay in registers. Megatron skips the clip product unless
      the norm exceeds the threshold; folded here, it costs nothing either way. The norm itself
      (`_foreach_norm`: multi_tensor_l2norm) is a pass of its own."""
    plan, nodes, group = {}, graph.node_attrs, []
    for node, data in nodes.items():
        if data["kind"] == "tensor" or data["phase"] != "optimizer" or not launches_kernel(data):
            continue
        if data["kind"] == "op" and _host_only(graph, node):
            plan[node] = -1
        elif profile == "fused" and data["name"].startswith("aten._foreach_") and data["name"] != "aten._foreach_norm":
            group.append(node)
        else:
            _close_pass(graph, group, plan)
            group = []
    _close_pass(graph, group, plan)
    return plan


def _host_only(graph, node) -> bool:
    nodes = graph.node_attrs
    return all(nodes[t]["device"] == "cpu" and not nodes[t]["shape"] for t in (*graph.preds[node], *graph.succs[node]))


def _close_pass(graph, group: list, plan: dict) -> None:
    """One kernel for `group`, hosted by its first op: the group's memory traffic (see optimizer_plan) less
    what the host moves itself (never below 0)."""
    if not group:
        return
    nodes, inside = graph.node_attrs, set(group)
    read, written = {}, {}
    for op in group:
        # a copy overwrites its destinations (the first len(outputs) arguments) without reading them
        skip = len(graph.succs[op]) if nodes[op]["name"] in ("aten._foreach_copy_", "aten.copy_") else 0
        for t, edge in graph.preds[op].items():
            if edge.get("arg", 0) >= skip and not inside.intersection(graph.preds[t]):
                read[t] = nodes[t]["bytes"]
        for t in graph.succs[op]:
            if nodes[t]["name"] != f"t{t}":  # named: parameters and optimizer state, not temporaries
                written[nodes[t]["name"]] = nodes[t]["bytes"]
    host = nodes[group[0]]
    plan[group[0]] = max(0, sum(read.values()) + sum(written.values()) - host["bytes_read"] - host["bytes_written"])
    plan.update(dict.fromkeys(group[1:], -1))


class _FusedPlan:
    """One pass in traced order (module docstring, fused profile)."""

    def __init__(self, graph):
        self.graph, self.plan = graph, {}
        self.host_of = {}  # tensor -> the kernel (host op) that produced it, through views and fused ops
        self.last_kernel = None  # the kernel-launching node that ran last (op or collective), with its phase
        self.pending = []  # fusible ops waiting for the next kernel that reads them
        for node, data in graph.node_attrs.items():
            if data["kind"] != "tensor":
                self.visit(node, data)
        self.flush()

    def visit(self, node, data):
        inputs = list(self.graph.preds[node])
        if not launches_kernel(data) or self.layout_only(node, data, inputs):
            if launches_kernel(data):
                self.plan[node] = -1
            host = next((self.host_of[t] for t in inputs if t in self.host_of), None)
            self.mark_outputs(node, host)
            return
        if self.pending and self.phase(self.pending[0]) != data["phase"]:
            self.flush()  # a kernel runs within one phase
        if data["kind"] == "op" and data["name"] in FUSIBLE:
            host = self.last_kernel
            if (host is not None and self.graph.node_attrs[host]["kind"] == "op" and self.phase(host) == data["phase"]
                    and any(self.host_of.get(t) == host for t in inputs)):
                self.join(node, host)
            else:
                self.pending.append(node)
                self.mark_outputs(node, ("pending", node))
            return
        if data["kind"] == "op" and any(isinstance(self.host_of.get(t), tuple) for t in inputs):
            for op in self.pending:
                self.join(op, node)
            self.pending = []
        self.flush()
        self.last_kernel = node
        self.mark_outputs(node, node)

    def layout_only(self, node, data, inputs) -> bool:
        """A cat that only arranges the chunks of an all-gather, or the chunks for a reduce-scatter, along
        the sequence: Megatron keeps activations [s, b, h], so its chunks are already in place. Not one along
        the last dimension (the vocabulary-parallel logits gathered for sampling): Megatron's
        _gather_along_last_dim copies them into rows (torch.cat), FasterTransformer's ParallelGpt too
        (invokeTransposeAxis01 after the all-gather)."""
        if data["name"] != "aten.cat" or self.along_last_dim(node, inputs):
            return False
        nodes, graph = self.graph.node_attrs, self.graph
        hosts = {self.host_of.get(t) for t in inputs}
        from_collective = len(hosts) == 1 and None not in hosts and not isinstance(next(iter(hosts)), tuple) \
            and nodes[next(iter(hosts))]["kind"] == "collective"
        consumers = [c for t in graph.succs[node] for c in graph.succs[t]]
        to_collective = bool(consumers) and all(nodes[c]["kind"] == "collective" for c in consumers)
        return from_collective or to_collective

    def along_last_dim(self, node, inputs) -> bool:
        """Does the cat join its chunks along their last dimension?"""
        nodes = self.graph.node_attrs
        out = next((nodes[t]["shape"] for t in self.graph.succs[node]), [])
        first = nodes[inputs[0]]["shape"] if inputs else []
        return len(out) == len(first) >= 2 and out[:-1] == first[:-1] and out[-1] != first[-1]

    def flush(self):
        """Pending ops no kernel read: one kernel of their own, hosted by the first."""
        if self.pending:
            host = self.pending[0]
            for op in self.pending[1:]:
                self.join(op, host)
            self.mark_outputs(host, host)
            self.last_kernel, self.pending = host, []

    def join(self, op, host):
        self.plan[op] = -1
        self.plan[host] = self.plan.get(host, 0) + self.folded_bytes(op)
        self.mark_outputs(op, host)

    def folded_bytes(self, op) -> int:
        data, graph = self.graph.node_attrs[op], self.graph
        largest = max((graph.node_attrs[t]["bytes"] for t in graph.preds[op]), default=0)
        return max(0, data["bytes_read"] + data["bytes_written"] - 2 * largest)

    def mark_outputs(self, node, host):
        for t in self.graph.succs[node]:
            self.host_of[t] = host

    def phase(self, node):
        return self.graph.node_attrs[node]["phase"]
