"""Chakra ctrl_deps: one chain per process group (NCCL's one stream per communicator) and one per pair of
ranks that send to each other (shared with a group of the same two ranks: ASTRA-sim matches both under the
pair's pg_name), never across them, on a traced TP x DP x PP training step."""
import json
from collections import defaultdict

import pytest
import torch
from chakra.schema.protobuf import et_def_pb2 as et
from chakra_graphs import attrs, read_et
from conftest import tiny_config

from syntorch.chakra.validator import check_traces
from syntorch.parallel.plans import TrainPlan
from syntorch.workload import trace_workload, write_workload

COMM = (et.COMM_COLL_NODE, et.COMM_SEND_NODE, et.COMM_RECV_NODE)


def channel(node, rank: int, groups: dict) -> tuple:
    """The ranks a communication node involves: its peer and itself, or its group."""
    a = attrs(node)
    if node.type == et.COMM_SEND_NODE:
        return tuple(sorted((rank, a["comm_dst"].int32_val)))
    if node.type == et.COMM_RECV_NODE:
        return tuple(sorted((rank, a["comm_src"].int32_val)))
    return tuple(sorted(groups[a["pg_name"].string_val]))


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    plan = TrainPlan(dp=2, tp=2, pp=2, zero=1, microbatches=3, seq=16)
    out = tmp_path_factory.mktemp("channels") / "t"
    write_workload(trace_workload(tiny_config("gpt2", n_layer=4), plan, torch.float32), out, progress=False)
    return out


def test_ctrl_deps_chain_each_group_and_each_peer_apart(traces):
    assert check_traces(traces)[0] == []
    groups = json.loads((traces / "comm_groups.json").read_text())
    for rank in range(8):
        _, nodes = read_et(traces / f"tiny-gpt2.{rank}.et")  # the official reader
        by_id = {n.id: n for n in nodes}
        chains = defaultdict(list)
        for node in nodes:  # file order is id order
            if node.type in COMM:
                chains[channel(node, rank, groups)].append(node)
            else:
                assert not node.ctrl_deps
        # TP, DP (ZeRO-1's reduce-scatter and all-gather), the pipeline peer with the tied embedding's pair, and
        # the gradient norm's (the world, under ZeRO)
        assert sorted(map(len, chains)) == [2, 2, 2, 8]
        for chain in chains.values():
            # within a channel the traced order is kept: each node waits for the one before it
            assert [list(n.ctrl_deps) for n in chain] == [[]] + [[n.id] for n in chain[:-1]]
        for node in nodes:
            assert all(channel(by_id[d], rank, groups) == channel(node, rank, groups) for d in node.ctrl_deps)
        # and channels interleave in the file (a chain over every communication node would join them)
        comm = [channel(n, rank, groups) for n in nodes if n.type in COMM]
        assert any(a != b for a, b in zip(comm, comm[1:]))
