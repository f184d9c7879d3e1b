"""Chakra ctrl_deps: one chain per process group (NCCL's one stream per communicator) and one per pair of
ranks that send to each other, never across them, on a traced TP x DP x PP training step."""
from collections import defaultdict

import pytest
import torch
from chakra.schema.protobuf import et_def_pb2 as et
from chakra_graphs import attrs, read_et
from conftest import tiny_config

from syntorch.chakra.validate import check_traces
from syntorch.parallel.plans import TrainPlan
from syntorch.workload import trace_workload, write_workload

COMM = (et.COMM_COLL_NODE, et.COMM_SEND_NODE, et.COMM_RECV_NODE)


def channel(node) -> tuple:
    a = attrs(node)
    if node.type == et.COMM_SEND_NODE:
        return "p2p", a["comm_dst"].int32_val
    if node.type == et.COMM_RECV_NODE:
        return "p2p", a["comm_src"].int32_val
    return "group", a["pg_name"].string_val


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    plan = TrainPlan(dp=2, tp=2, pp=2, zero=1, microbatches=3, seq=16)
    out = tmp_path_factory.mktemp("channels") / "t"
    write_workload(trace_workload(tiny_config("gpt2", n_layer=4), plan, torch.float32), out, progress=False)
    return out


def test_ctrl_deps_chain_each_group_and_each_peer_apart(traces):
    assert check_traces(traces)[0] == []
    for rank in range(8):
        _, nodes = read_et(traces / f"tiny-gpt2.{rank}.et")  # the official reader
        by_id = {n.id: n for n in nodes}
        chains = defaultdict(list)
        for node in nodes:  # file order is id order
            if node.type in COMM:
                chains[channel(node)].append(node)
            else:
                assert not node.ctrl_deps
        # TP, DP (ZeRO-1's reduce-scatter and all-gather), the tied embedding, the gradient norm's (the world,
        # under ZeRO), and the pipeline peer
        assert len([c for c in chains if c[0] == "group"]) == 4 and len([c for c in chains if c[0] == "p2p"]) == 1
        for chain in chains.values():
            # within a channel the traced order is kept: each node waits for the one before it
            assert [list(n.ctrl_deps) for n in chain] == [[]] + [[n.id] for n in chain[:-1]]
        for node in nodes:
            assert all(channel(by_id[d]) == channel(node) for d in node.ctrl_deps)
        # and channels interleave in the file (a chain over every communication node would join them)
        comm = [channel(n) for n in nodes if n.type in COMM]
        assert any(a != b for a, b in zip(comm, comm[1:]))
