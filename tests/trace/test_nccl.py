"""trace/nccl.py: collective times as NCCL runs them, checked against NCCL's own cost model (tuning.cc's
steps), the identity all-reduce = reduce-scatter + all-gather, and nccl-tests' bus bandwidths."""
import dataclasses

import pytest

from syntorch.hardware import PRESETS
from syntorch.trace.nccl import collective_us

H100, A100 = PRESETS["h100-sxm"], PRESETS["a100-80gb"]
NO_LATENCY = dict(collective_latency_us=0.0, intra_node_latency_us=0.0, inter_node_latency_us=0.0)
GB = 10**9


def nvlink(hw, nbytes, fraction):
    return 1e6 * fraction * nbytes / (hw.intra_node_bw_gb_s * 1e9 * hw.intra_node_bus_efficiency)


def nic(hw, nbytes, fraction):
    return 1e6 * fraction * nbytes / (hw.inter_node_bw_gb_s * 1e9 * hw.inter_node_bus_efficiency)


def test_collectives_inside_a_node_are_rings_at_nccl_bus_bandwidth():
    mb, lat, c = 10**6, H100.intra_node_latency_us, H100.collective_latency_us
    node = list(range(8))
    assert collective_us("all_reduce", mb, node, H100) == pytest.approx(c + 14 * lat + nvlink(H100, mb, 2 * 7 / 8))
    assert collective_us("reduce_scatter", mb, node, H100) == pytest.approx(c + 7 * lat + nvlink(H100, mb, 7 / 8))
    assert collective_us("all_gather", mb, node, H100) == pytest.approx(c + 7 * lat + nvlink(H100, mb, 7 / 8))
    assert collective_us("all_reduce", mb, [3], H100) == 0.0


def test_rings_across_nodes_take_nccls_steps_and_every_nic():
    mb, lat, net, c = 10**6, H100.intra_node_latency_us, H100.inter_node_latency_us, H100.collective_latency_us
    # 2 nodes x 8 ranks: tuning.cc's ring has nsteps - nInterSteps = 15 - 1 NVLink steps and 1 network step; the
    # 8 NICs of each node carry the channels' crossings in parallel (here NVLink, the slower, bounds them)
    busbw = min(8 * H100.inter_node_bw_gb_s * H100.inter_node_bus_efficiency,
                H100.intra_node_bw_gb_s * H100.intra_node_bus_efficiency) * 1e9
    assert collective_us("all_gather", mb, list(range(16)), H100) == pytest.approx(
        c + 14 * lat + net + 1e6 * 15 / 16 * mb / busbw)
    # one rank per node (the DP group under TP 8): its own NIC only; the ring's 3 network steps
    ranks = [0, 8, 16, 24]
    assert collective_us("all_gather", mb, ranks, H100) == pytest.approx(c + 3 * net + nic(H100, mb, 3 / 4))
    # all-reduce: the tree's 2 log2(4) = 4 network steps beat the ring's 6, the bandwidth is the same
    assert collective_us("all_reduce", mb, ranks, H100) == pytest.approx(c + 4 * net + nic(H100, mb, 2 * 3 / 4))


@pytest.mark.parametrize("ranks", [8, 48, 1024])
def test_all_reduce_is_reduce_scatter_plus_all_gather(ranks):
    """NCCL runs an all-reduce as a reduce-scatter then an all-gather of the same bytes: without latencies
    the times are equal, inside a node and across 6 or 128 nodes of 8 H100s."""
    group, nbytes, hw = list(range(ranks)), 3.4 * GB, dataclasses.replace(H100, **NO_LATENCY)
    both = collective_us("reduce_scatter", nbytes, group, hw) + collective_us("all_gather", nbytes, group, hw)
    assert collective_us("all_reduce", nbytes, group, hw) == pytest.approx(both)
    # with them, the all-reduce saves one call's fixed cost and (across nodes) may take the tree's fewer steps
    both = collective_us("reduce_scatter", nbytes, group, H100) + collective_us("all_gather", nbytes, group, H100)
    assert collective_us("all_reduce", nbytes, group, H100) <= both
    if ranks <= 48:
        assert collective_us("all_reduce", nbytes, group, H100) == pytest.approx(both, rel=0.02)


def bus_bandwidth_gb_s(collective, nbytes, ranks, hw):
    """nccl-tests' busbw: B * moved fraction / time."""
    n = len(ranks)
    moved = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}[collective]
    return nbytes * moved / collective_us(collective, nbytes, ranks, hw) / 1e3


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_bus_bandwidth_across_nodes_is_every_nic_of_the_node(collective):
    # DGX A100, 8 x HDR: NICs x 25 GB/s x the NIC's bus efficiency, ~184 GB/s (nccl-tests measure ~24 GB/s per
    # HDR NIC, NVIDIA/nccl#412), reached for large messages on 2 and on 16 nodes
    for nodes in (2, 16):
        busbw = bus_bandwidth_gb_s(collective, 8 * GB, list(range(8 * nodes)), A100)
        assert busbw == pytest.approx(8 * 25 * A100.inter_node_bus_efficiency, rel=0.02)
    # a group with one rank per node has that rank's NIC only
    assert bus_bandwidth_gb_s(collective, 8 * GB, [0, 8, 16, 24], A100) == pytest.approx(
        25 * A100.inter_node_bus_efficiency, rel=0.02)
    # NICs faster than NVLink: NVLink bounds the ring (the NICs "up to the NVLink intra-node bandwidth")
    fast = dataclasses.replace(A100, inter_node_bw_gb_s=100.0)
    assert bus_bandwidth_gb_s(collective, 8 * GB, list(range(16)), fast) == pytest.approx(
        300 * A100.intra_node_bus_efficiency, rel=0.02)


def test_all_to_all_across_nodes_is_bounded_by_each_ranks_own_nic():
    nbytes = 1 * GB
    inside = collective_us("all_to_all", nbytes, list(range(8)), H100)
    across = collective_us("all_to_all", nbytes, list(range(16)), H100)
    assert across > 4 * inside  # half of B at one NIC (46 GB/s) against 7/8 of it at NVLink (346)
    # 8 of 16 ranks are in the other node: half of B leaves through the rank's one NIC
    assert across == pytest.approx(nic(H100, nbytes, 8 / 16), rel=0.01)
    # the other collectives use every NIC of the node
    assert collective_us("all_gather", nbytes, list(range(16)), H100) < across / 3


def test_p2p_has_its_own_latency_and_is_cheaper_than_an_all_reduce_call():
    small, mb = 1024, 10**6
    assert collective_us("send", mb, [0, 1], H100) == pytest.approx(
        H100.p2p_latency_us + H100.intra_node_latency_us + nvlink(H100, mb, 1))
    assert collective_us("recv", mb, [0, 8], H100) == pytest.approx(
        H100.p2p_latency_us + H100.inter_node_latency_us + nic(H100, mb, 1))
    for peers in ([0, 1], [0, 8]):
        assert collective_us("send", small, peers, H100) < collective_us("all_reduce", small, peers, H100) / 3
