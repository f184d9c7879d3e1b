"""Per-node durations of a trace from a HardwareConfig and the software: a profile (eager | fused) and an
attention kernel (flash | unfused).

Compute ops: kernels.py (which ops launch kernels under the profile; GEMM tiles and waves, achievable
bandwidth, a fixed cost per kernel, fused attention). Collectives: nccl.py (ring or tree, bus bandwidth,
per-step latency, hierarchical across nodes). An op that runs inside another op's kernel (fused profile)
gets 0; the kernel it joins carries its time.

    fill_durations(graph, hw, profile="fused", attention="flash")   # sets duration_us on every op and collective

Durations only: syntorch/simulate composes them (streams, ranks, pipelines), for every command.
"""
import math
from dataclasses import dataclass

import networkx as nx
import torch

from syntorch.errors import UserError
from syntorch.hardware import HardwareConfig
from syntorch.trace.kernels import (ATTENTION, ATTENTION_KERNELS, GEMMS, PROFILES, RADIX_OPS, attention_us,
                                    compute_us, foreach_launches, gemm_us, kernel_plan, launches_kernel,
                                    radix_bytes)
from syntorch.trace.graph import graph_kinds
from syntorch.trace.nccl import collective_us
from syntorch.trace.tracer import SDPA

__all__ = ["ATTENTION_KERNELS", "PROFILES", "Kernel", "add_host_waits", "check_attention", "check_profile",
           "collective_us", "compute_us", "fill_durations", "fill_rank_durations", "kernel_of", "kernel_plan",
           "kernel_us", "node_us", "op_dtype"]


def check_profile(profile: str) -> str:
    if profile not in PROFILES:
        raise UserError(f"unknown --profile {profile!r}; use one of {', '.join(PROFILES)}")
    return profile


def check_attention(attention: str) -> str:
    if attention not in ATTENTION_KERNELS:
        raise UserError(f"unknown --attention {attention!r}; use one of {', '.join(ATTENTION_KERNELS)}")
    return attention


def check_profile_needs_hw(profile: str, hw_config, attention: str = "flash") -> None:
    """A profile groups ops into kernels for the performance model, --attention picks one; without a device there
    is none."""
    if profile != "eager" and not hw_config:
        raise UserError(f"--profile {profile} chooses how predicted durations group ops into kernels; "
                        "give --hw_config too")
    if attention != "flash" and not hw_config:
        raise UserError(f"--attention {attention} chooses the kernel of predicted durations; give --hw_config too")


@dataclass(frozen=True)
class Kernel:
    """What a node's duration depends on, apart from the hardware: equal for the same op in every layer."""
    kind: str  # "gemm" | "attention" | "compute" | "collective" | "none" (no kernel, or inside another's)
    name: str = ""
    flops: int = 0
    nbytes: int = 0
    dtype: str = "float32"
    shape: tuple = ()  # gemm: (batch, m, n, k); attention: (q shape, k shape, training); collective: its ranks;
    # compute: (launches,) for a multi-tensor (foreach) op, else ()


def kernel_of(graph: nx.DiGraph, node, plan: dict) -> Kernel:
    """The kernel `node` launches under `plan` (kernel_plan(graph, profile))."""
    data = graph.node_attrs[node]
    if data["kind"] == "collective":
        return Kernel("collective", data["collective"], nbytes=data["bytes"], shape=tuple(_peers(graph, data)))
    folded = plan.get(node, 0)
    if not launches_kernel(data) or folded < 0:
        return Kernel("none")
    # a lookup reads the rows it returns, not the whole table it is given
    read = data["bytes_written"] if data["name"] in LOOKUPS else data["bytes_read"]
    radix = _radix_bytes(graph, node, data) if data["name"] in RADIX_OPS else None
    nbytes, dtype = (read + data["bytes_written"] if radix is None else radix) + folded, op_dtype(graph, node)
    # a GEMM or attention whose shapes a file does not give (a Chakra file of strangers') is a plain kernel
    gemm = _gemm_shape(graph, node, data) if data["name"] in GEMMS else None
    if gemm:
        return Kernel("gemm", data["name"], data["flops"], nbytes, dtype, gemm)
    attention = _attention_shapes(graph, node, data) if data["name"] in ATTENTION else None
    if attention:
        return Kernel("attention", data["name"], data["flops"], nbytes, dtype, attention)
    # a foreach op (or the multi-tensor pass it hosts) launches once per multi_tensor_apply batch
    launches = (foreach_launches(graph, node),) if data["name"].startswith("aten._foreach_") else ()
    return Kernel("compute", data["name"], data["flops"], nbytes, dtype, launches)


def kernel_us(kernel: Kernel, hw: HardwareConfig, profile: str = "eager", attention: str = "flash") -> float:
    if kernel.kind == "collective":
        return collective_us(kernel.name, kernel.nbytes, list(kernel.shape), hw)
    if kernel.kind == "gemm":
        return gemm_us(*kernel.shape, kernel.nbytes, kernel.dtype, hw)
    if kernel.kind == "attention":
        q, k, training = kernel.shape
        return attention_us(kernel.name, kernel.flops, kernel.nbytes, q, k, kernel.dtype, hw, profile, attention, training)
    if kernel.kind == "compute":
        return compute_us(kernel.flops, kernel.nbytes, kernel.dtype, hw, launches=kernel.shape[0] if kernel.shape else 1)
    return 0.0


def node_us(graph: nx.DiGraph, node, hw: HardwareConfig, profile: str = "eager", plan: dict | None = None,
            attention: str = "flash") -> float:
    """Duration of one op or collective. `plan`: kernel_plan(graph, profile), when costing many nodes."""
    plan = kernel_plan(graph, check_profile(profile)) if plan is None else plan
    return kernel_us(kernel_of(graph, node, plan), hw, profile, check_attention(attention))


LOOKUPS = frozenset({"aten.embedding", "aten.index_select", "aten.gather", "aten.index"})


def fill_durations(graph: nx.DiGraph, hw: HardwareConfig, profile: str = "eager", attention: str = "flash") -> None:
    """Sets `duration_us` on every op and collective node of `graph` (in place); under the eager profile each
    includes the time its kernel waited for the host to issue it (add_host_waits)."""
    plan = kernel_plan(graph, check_profile(profile))
    check_attention(attention)
    set_durations(graph, ((n, d) for n, d in graph.node_attrs.items() if d["kind"] != "tensor"), plan, hw, profile,
                  attention)
    if profile == "eager" and hw.host_overhead_us:
        add_host_waits(graph, hw.host_overhead_us)


def set_durations(graph: nx.DiGraph, nodes, plan: dict, hw: HardwareConfig, profile: str, attention: str) -> None:
    """Sets `duration_us` on each of `nodes` ((node, attributes) pairs of `graph`), each distinct kernel costed
    once: every layer's ops launch the same ones. `plan`: kernel_plan's (empty for collectives alone)."""
    us = {}
    for node, data in nodes:
        kernel = kernel_of(graph, node, plan)
        if kernel not in us:
            us[kernel] = kernel_us(kernel, hw, profile, attention)
        data["duration_us"] = us[kernel]


def add_host_waits(graph: nx.DiGraph, host_us: float) -> None:
    """Eager PyTorch issues one kernel per aten op (and each NCCL call) from one host thread, `host_us` each,
    while the GPU runs what was issued; a kernel starts once it is issued and the kernel before it has ended:
    start_i = max(end_(i-1), issued_i), issued_i = issued_(i-1) + host_us. So a stream of short kernels runs at
    the host's rate, and long kernels let the host run ahead (its lead carries over to the short ones after them).
    The GPU's wait is added to the compute kernel that waited; a collective's, to the next compute kernel (it
    waits for the collective's result), so communication keeps NCCL's time and the idle lands on compute.

    Inference only: the clocks meet (the host waits for the GPU) at the start of each generation step, where
    generate reads the chosen ids on the host before it feeds them in, so a step's durations do not depend on
    the steps before it. Training phases are left as the GPU runs them: a training step's host has no such
    sync between its micro-batches (it runs ahead of kernels that are long), and the steps a probe's
    micro-batches are costed as (simulate/steps.py) must not depend on the order they were traced in.
    One clock for every stream (a collective that overlapped compute would make it late, the waits small).
    Under the fused profile (FasterTransformer's C++ loop, Megatron's large kernels, CUDA graphs) the host keeps
    ahead and kernel_overhead_us alone spaces the kernels."""
    issued = gpu = carried = 0.0
    phase = None
    for data in graph.node_attrs.values():
        if data["kind"] == "tensor" or not data.get("duration_us") or not is_generation_step(data.get("phase")):
            continue  # no kernel (views, ops inside another's kernel), or not inference
        if data["phase"] != phase:
            phase, issued = data["phase"], gpu
        issued += host_us
        wait = max(0.0, issued - gpu)
        gpu += wait + data["duration_us"]
        if data["kind"] == "collective":
            carried += wait
        else:
            data["duration_us"] += carried + wait
            carried = 0.0


def is_generation_step(phase: str | None) -> bool:
    """prefill, decode[i] or an encoder's pass (trace/graph.py's phases), not forward/backward/optimizer."""
    return phase in ("prefill", "encode") or (phase or "").startswith("decode[")


def op_dtype(graph: nx.DiGraph, node) -> str:
    """The dtype an op computes in: its first FP8 input (an FP8 GEMM writes BF16 but multiplies in FP8), else its
    first floating-point output, else input, else float32."""
    inputs = [graph.node_attrs[t]["dtype"].removeprefix("torch.") for t in graph.preds[node]]
    outputs = [graph.node_attrs[t]["dtype"].removeprefix("torch.") for t in graph.succs[node]]
    fp8 = [d for d in inputs if d.startswith("float8")]
    return next((d for d in (*fp8, *outputs, *inputs) if d.startswith(("float", "bfloat"))), "float32")


def _inputs(graph, node) -> list:
    """Input tensors in argument order."""
    return [t for t, _ in sorted(graph.preds[node].items(), key=lambda item: item[1].get("arg", 0))]


def _attention_shapes(graph, node, data) -> tuple | None:
    """(q shape, k shape, in a training pass?): the forward reads (q, k, v[, mask]), the backward (grad, q, k, v).
    A graph read from Chakra files gives them as the node's `input_shapes` (its edges come from other nodes'
    outputs)."""
    shapes = data.get("input_shapes") or [graph.node_attrs[t]["shape"] for t in _inputs(graph, node)]
    q, k = ((shapes[:2] if data["name"] == SDPA else shapes[1:3]) + [[], []])[:2]
    training = data.get("phase") in ("forward", "backward")
    return (tuple(q), tuple(k), training) if len(q) >= 2 and len(k) >= 2 else None


def _radix_bytes(graph, node, data) -> int | None:
    """A sort's or top-k's passes over its keys (kernels.radix_bytes); None when the graph does not give the
    keys' shape (a Chakra file of strangers')."""
    inputs = _inputs(graph, node)
    indices = next((graph.node_attrs[t] for t, e in graph.succs[node].items() if e.get("arg") == 1), None)
    keys = graph.node_attrs[inputs[0]] if inputs else {}
    if not keys.get("shape") or indices is None:
        return None
    key_bytes, index_bytes = (getattr(torch, d["dtype"].removeprefix("torch.")).itemsize for d in (keys, indices))
    return radix_bytes(data["name"], math.prod(keys["shape"]), key_bytes, index_bytes, data["bytes_written"])


def _gemm_shape(graph, node, data) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) from the output's shape and the FLOPs (2 m n k per batch entry); None when the graph
    does not know the shape (a Chakra file that does not give it)."""
    out = next(iter(graph.succs[node]), None)
    shape = graph.node_attrs[out]["shape"] if out is not None else []
    if not shape:
        return None
    m, n = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[-1])
    batch = 1
    for size in shape[:-2]:
        batch *= size
    k = data["flops"] // max(1, 2 * batch * m * n)
    return batch, m, n, k


def _peers(graph: nx.DiGraph, data: dict) -> list[int]:
    if data["collective"] in ("send", "recv"):
        rank = graph.graph.get("rank", 0)
        peer = data["dst"] if data["collective"] == "send" else data["src"]
        return [rank, rank if peer is None else peer]
    return data["group"]


def fill_rank_durations(graphs_by_rank, hw: HardwareConfig, profile: str = "eager", attention: str = "flash") -> None:
    """fill_durations on every rank's graph, once per distinct graph (shared ones share durations)."""
    for graph, _ in graph_kinds(graphs_by_rank):
        fill_durations(graph, hw, profile, attention)
