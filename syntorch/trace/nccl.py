"""Collective times as NCCL runs them, from a HardwareConfig's link figures.

NCCL's own tuning model (src/graph/tuning.cc) gives a collective a base latency, a latency per ring step
(hwLat: per NVLink step inside a node, per network step across) and a bus bandwidth; so do we. A collective
of n ranks on N nodes (at least `local` of its ranks on each), on B bytes (the node's `bytes`: the larger of
its input and output buffer, as nccl-tests count a collective's size), costs
    collective_latency_us + passes * ((n - N) * NVLink step + (N - 1) * network step) + moved(B) / busbw
with, for NCCL's ring (tuning.cc: nsteps - nInterSteps NVLink steps, nInterSteps network steps):
    all_reduce      2 passes, moves 2(n-1)/n B   (reduce-scatter then all-gather)
    reduce_scatter  1 pass,   moves (n-1)/n B    (B is the input)
    all_gather      1 pass,   moves (n-1)/n B    (B is the output)
    broadcast       1 pass,   moves B            (pipelined ring)
    barrier         2 passes, moves nothing
so an all-reduce costs a reduce-scatter plus an all-gather of the same bytes, inside a node and across.
"moved / busbw" is nccl-tests' bus bandwidth read backwards (busbw = B * moved fraction / time); busbw is
the link's datasheet bandwidth times its bus efficiency:
- inside a node, NVLink's;
- across nodes, a DGX node has one NIC per GPU and NCCL runs its ring channels through all of them in
  parallel, NVLink hops and NIC hops pipelined: every channel crosses each node boundary once, so the
  node's traffic out is spread over the `local` NICs of the group's ranks there, and the bus bandwidth is
  min(local * NIC, NVLink). nccl-tests measure ~24 GB/s per HDR NIC, growing with the NICs in use "up to
  ... the NVLink intra-node bandwidth" (S. Jeaugey, NVIDIA/nccl#412; 4 x HDR: 86 of 96 GB/s,
  NVIDIA/nccl#1048), so ~185 GB/s across DGX A100 nodes (8 x HDR), and 46-48 GB/s per NDR NIC
  (NVIDIA/nccl-tests#290).
An all-reduce across nodes takes NCCL's double binary tree instead when its latency is lower (tuning.cc:
2 ((n/N - 1) NVLink steps + log2 N network steps), the same bus bandwidth): small messages.
An all-to-all is point-to-point: each rank's share for its node's peers goes over NVLink and the rest,
(n - local)/n of B, over its own NIC, at the same time; it cannot aggregate the node's NICs (S. Jeaugey,
NVIDIA/nccl-tests#267: "the performance you should see is the performance of a single NIC").
Send / recv: NCCL's base latency for its Simple protocol (hw.p2p_latency_us), plus one step of the link (NVLink,
or the network between nodes), plus B at that link's bus bandwidth; not the fitted collective_latency_us,
which is an all-reduce call's fixed cost.
"""
import math
from collections import Counter

from syntorch.hardware import HardwareConfig

# collective -> (ring passes: passes * (n - 1) steps, fraction of B each rank moves) for n ranks
RING = {
    "all_reduce": (2, lambda n: 2 * (n - 1) / n),
    "reduce_scatter": (1, lambda n: (n - 1) / n),
    "all_gather": (1, lambda n: (n - 1) / n),
    "all_to_all": (1, lambda n: (n - 1) / n),
    "broadcast": (1, lambda n: 1.0),
    "barrier": (2, lambda n: 0.0),
}


def collective_us(collective: str, nbytes: int, ranks: list[int], hw: HardwareConfig) -> float:
    """NCCL time of one collective over `ranks` (global ranks; p2p: the two peers)."""
    ranks = sorted(set(ranks))
    n = len(ranks)
    if n <= 1:
        return 0.0
    per_node = Counter(r // hw.devices_per_node for r in ranks)
    nodes, local = len(per_node), min(per_node.values())
    nvlink = hw.intra_node_bw_gb_s * 1e3 * hw.intra_node_bus_efficiency  # bytes per us
    nic = hw.inter_node_bw_gb_s * 1e3 * hw.inter_node_bus_efficiency
    if collective in ("send", "recv"):
        step, bandwidth = (hw.intra_node_latency_us, nvlink) if nodes == 1 else (hw.inter_node_latency_us, nic)
        return hw.p2p_latency_us + step + nbytes / bandwidth
    passes, fraction = RING[collective]
    steps = passes * ((n - nodes) * hw.intra_node_latency_us + (nodes - 1) * hw.inter_node_latency_us)
    if nodes == 1:
        return hw.collective_latency_us + steps + fraction(n) * nbytes / nvlink
    if collective == "all_to_all":
        return hw.collective_latency_us + steps + max((n - local) / n * nbytes / nic, (local - 1) / n * nbytes / nvlink)
    if collective == "all_reduce":
        tree = 2 * ((local - 1) * hw.intra_node_latency_us + math.ceil(math.log2(nodes)) * hw.inter_node_latency_us)
        steps = min(steps, tree)
    return hw.collective_latency_us + steps + fraction(n) * nbytes / min(local * nic, nvlink)
