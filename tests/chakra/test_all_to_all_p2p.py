"""A skewed MoE load's all-to-alls written as sends and recvs of each pair's own bytes (chakra/nodes.py's
_p2p_parts), checked against the bytes each rank's tracer saw in its splits, traced rank by rank; a uniform
load's stay ALL_TO_ALL collectives."""
from collections import defaultdict

import pytest
import torch
from chakra.schema.protobuf import et_def_pb2 as et
from conftest import tiny_config

from syntorch.chakra.nodes import A2A_TAG_BASE
from syntorch.chakra.reader import find_traces, read_trace
from syntorch.chakra.validator import check_traces
from syntorch.parallel.moe_load import parse_load
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.training import trace_stage
from syntorch.workload import trace_workload, write_workload

MOE = tiny_config("gpt2", n_layer=2, vocab_size=200, n_experts=4, moe_top_k=2)


def _plan(load: str | None) -> TrainPlan:
    return TrainPlan(dp=4, ep=4, microbatches=2, seq=16, moe_load=parse_load(load, MOE) if load else None)


def _p2p(folder) -> dict:
    """(src, dst) -> sizes of the all-to-all messages in file order, sent (as the sender's file says) and
    received (as the receiver's says)."""
    sent, received = defaultdict(list), defaultdict(list)
    for rank, path in find_traces(folder):
        for node in read_trace(path)[1]:
            attrs = {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr}
            if attrs.get("comm_tag", 0) < A2A_TAG_BASE:
                continue
            if node.type == et.COMM_SEND_NODE:
                sent[rank, attrs["comm_dst"]].append((attrs["comm_tag"], attrs["comm_size"]))
            elif node.type == et.COMM_RECV_NODE:
                received[attrs["comm_src"], rank].append((attrs["comm_tag"], attrs["comm_size"]))
    return sent, received


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    plan = _plan("zipf:1.2")
    folder = tmp_path_factory.mktemp("skewed") / "run"
    write_workload(trace_workload(MOE, plan, torch.float32), folder, level="op", progress=False)
    return plan, folder


def test_a_skewed_folder_validates_clean(skewed):
    _, folder = skewed
    problems, files, _ = check_traces(folder)
    assert problems == [] and files == 4


def test_each_pair_sends_what_the_tracer_split(skewed):
    """Each rank traced on its own: its k-th variable all-to-all's send split to a peer is the k-th message
    of the pair in the files, and the peer's recv of it has the same size and tag."""
    plan, folder = skewed
    sent, received = _p2p(folder)
    assert sent == received and sent
    for rank in range(plan.mesh.world_size):
        graph = trace_stage(MOE, plan, 0, rank=rank)
        a2a = [d for _, d in graph.collectives() if d["collective"] == "all_to_all" and "send_bytes" in d]
        group = a2a[0]["group"]
        for peer in group:
            if peer != rank:
                want = [max(d["send_bytes"][group.index(peer)], 1) for d in a2a]
                assert [size for _, size in sent[rank, peer]] == want, (rank, peer)
        # what a rank sends in all, off itself, is what its files send
        total = sum(b for d in a2a for j, b in zip(d["group"], d["send_bytes"]) if j != rank)
        assert sum(size for (src, _), msgs in sent.items() if src == rank for _, size in msgs) == total
    assert len({size for msgs in sent.values() for _, size in msgs}) > 1  # the skew makes unequal pairs


def test_a_uniform_load_keeps_its_all_to_all_collectives(tmp_path):
    write_workload(trace_workload(MOE, _plan(None), torch.float32), tmp_path / "run", level="op", progress=False)
    types = defaultdict(int)
    for _, path in find_traces(tmp_path / "run"):
        for node in read_trace(path)[1]:
            attrs = {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr}
            types[node.type, attrs.get("comm_type")] += 1
    assert types[et.COMM_COLL_NODE, et.ALL_TO_ALL] > 0
    assert types[et.COMM_SEND_NODE, None] == types[et.COMM_RECV_NODE, None] == 0
