"""Collective times as NCCL runs them, from a HardwareConfig's link figures.

A collective of n ranks on B bytes (the node's `bytes`: the larger of its input and output buffer, as
nccl-tests count a collective's size) costs
    collective_latency_us + steps * step latency + moved(B) / (link bandwidth * bus efficiency)
(NCCL's own tuning model has this form per protocol, src/graph/tuning.cc: a base latency, a latency per
step, a bus bandwidth; the calibration lands near its LL128 ring figures on NVLink, 14 us + 1.9 us per
step), with, for a ring (NCCL's algorithm inside a node and for all but all-reduce across nodes):
    all_reduce      2(n-1) steps, moves 2(n-1)/n B   (reduce-scatter then all-gather)
    reduce_scatter  (n-1) steps,  moves (n-1)/n B    (B is the input)
    all_gather      (n-1) steps,  moves (n-1)/n B    (B is the output)
    all_to_all      (n-1) steps,  moves (n-1)/n B
    broadcast       (n-1) steps,  moves B            (pipelined ring)
    send / recv     1 step,       moves B
    barrier         2(n-1) steps, moves nothing
"moved / (bandwidth * bus efficiency)" is nccl-tests' bus bandwidth read backwards: busbw = B * moved
fraction / time, so the bus efficiency is busbw over the link's datasheet bandwidth.

A group spanning nodes runs hierarchically (one NIC per GPU, as DGX nodes have): an all-reduce is a
reduce-scatter among the group's ranks in each node over NVLink, an all-reduce of each rank's 1/local
share across the N nodes over its own NIC, and an all-gather in the node. Across nodes NCCL picks a ring
(2(N-1) steps) or a double binary tree (2 ceil(log2 N) steps, the same bus bandwidth), whichever is
faster for the size: the tree for small messages, equal for large ones. Other collectives spanning nodes
run one ring whose slowest hop is the NIC.
"""
import math

from syntorch.hardware import HardwareConfig

# collective -> (ring steps, fraction of B each rank moves) for n ranks
RING = {
    "all_reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
    "reduce_scatter": lambda n: (n - 1, (n - 1) / n),
    "all_gather": lambda n: (n - 1, (n - 1) / n),
    "all_to_all": lambda n: (n - 1, (n - 1) / n),
    "broadcast": lambda n: (n - 1, 1.0),
    "send": lambda n: (1, 1.0),
    "recv": lambda n: (1, 1.0),
    "barrier": lambda n: (2 * (n - 1), 0.0),
}


def collective_us(collective: str, nbytes: int, ranks: list[int], hw: HardwareConfig) -> float:
    """NCCL time of one collective over `ranks` (global ranks; p2p: the two peers)."""
    ranks = sorted(set(ranks))
    n = len(ranks)
    if n <= 1:
        return 0.0
    per_node = {}
    for r in ranks:
        per_node[r // hw.devices_per_node] = per_node.get(r // hw.devices_per_node, 0) + 1
    nodes, local = len(per_node), max(per_node.values())
    if nodes == 1:
        return hw.collective_latency_us + _ring_us(collective, n, nbytes, _nvlink(hw))
    if collective != "all_reduce":
        return hw.collective_latency_us + _ring_us(collective, n, nbytes, _network(hw))
    inside = 2 * _ring_us("reduce_scatter", local, nbytes, _nvlink(hw)) if local > 1 else 0.0
    share = nbytes / local
    ring = _ring_us("all_reduce", nodes, share, _network(hw))
    tree_steps = 2 * math.ceil(math.log2(nodes))
    tree = ring - (2 * (nodes - 1) - tree_steps) * hw.inter_node_latency_us
    return hw.collective_latency_us + inside + min(ring, tree)


def _nvlink(hw: HardwareConfig) -> tuple[float, float]:
    """(bytes per us, latency per step in us) inside a node."""
    return hw.intra_node_bw_gb_s * 1e3 * hw.intra_node_bus_efficiency, hw.intra_node_latency_us


def _network(hw: HardwareConfig) -> tuple[float, float]:
    return hw.inter_node_bw_gb_s * 1e3 * hw.inter_node_bus_efficiency, hw.inter_node_latency_us


def _ring_us(collective: str, n: int, nbytes: float, link: tuple[float, float]) -> float:
    bytes_per_us, step_us = link
    steps, fraction = RING[collective](n)
    return steps * step_us + fraction * nbytes / bytes_per_us
