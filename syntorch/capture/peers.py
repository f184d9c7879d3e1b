"""The global peer of each send and recv in a gloo capture, found across the ranks' host traces.

A host trace's `c10d::send` / `c10d::recv_` records the peer as a rank *within* the op's process group and
the tag, but not the group (its ProcessGroup argument is written "<Object>"), and torch's flight recorder
logs no gloo point-to-point op. Each rank's own groups (the profiler's `pg_config`: name -> global ranks)
give the candidates: a send from rank r to group rank d of group G goes to G[d], and that rank must post
the matching recv, from group rank G.index(r), with the same tag and bytes (else the run would have hung).
The candidate that holds such a recv, the n-th for the n-th such send, is the peer. When none or several
do, the op's peer is left unknown (None) and repair.py leaves it a compute node, with a note.
"""
from collections import Counter
from typing import NamedTuple

from syntorch.capture import traces

P2P_OPS = {"c10d::send": "send", "c10d::recv_": "recv"}
OPPOSITE = {"send": "recv", "recv": "send"}


class PointToPoint(NamedTuple):
    kind: str  # "send" | "recv"
    local_peer: int  # the peer's rank within the op's process group
    tag: int
    nbytes: int


def point_to_point(node: dict) -> PointToPoint | None:
    """The op of a host-trace node, if it is a send or recv."""
    kind = P2P_OPS.get(node["name"])
    values = node.get("inputs", {}).get("values", [])
    # c10d::send(Tensor[] tensors, ProcessGroup process_group, int dstRank, int tag); recv_ alike
    if not kind or len(values) < 4 or not isinstance(values[2], int) or not isinstance(values[3], int):
        return None
    return PointToPoint(kind, values[2], values[3], sum(b for _, b in traces.tensor_refs(node["inputs"])))


def p2p_ops(host_nodes) -> list[tuple[int, PointToPoint]]:
    """(node id, op) of a host (or linked) trace's point-to-point ops, in issue order."""
    ops = ((n["id"], point_to_point(n)) for n in sorted(host_nodes, key=lambda n: n["id"]))
    return [(node_id, op) for node_id, op in ops if op is not None]


def read_ranks(files: list[tuple]) -> tuple[dict[int, list[PointToPoint]], dict[int, dict[str, list[int]]]]:
    """(each rank's p2p ops, each rank's process groups) from the (host trace, device trace) of ranks 0, 1, ..."""
    ops, groups = {}, {}
    for rank, (host_path, device_path) in enumerate(files):
        ops[rank] = [op for _, op in p2p_ops(traces.read_host_trace(host_path)[0]["nodes"])]
        groups[rank] = traces.comm_groups(traces.read_device_trace(device_path))
    return ops, groups


def find_peers(ops: dict[int, list[PointToPoint]], groups: dict[int, dict[str, list[int]]]) -> dict[int, list]:
    """rank -> the (global peer, group name) of each of its ops (None where not found); `ops` and `groups`
    per rank, the groups as each rank's profiler lists them."""
    index = {rank: Counter(rank_ops) for rank, rank_ops in ops.items()}
    found = {}
    for rank, rank_ops in ops.items():
        seen, peers = Counter(), []
        for op in rank_ops:
            seen[op] += 1
            matches = {}
            for name, members in groups.get(rank, {}).items():
                if rank not in members or op.local_peer >= len(members) or members[op.local_peer] == rank:
                    continue
                peer = members[op.local_peer]
                wanted = PointToPoint(OPPOSITE[op.kind], members.index(rank), op.tag, op.nbytes)
                if index.get(peer, {}).get(wanted, 0) >= seen[op]:
                    matches.setdefault(peer, name)
            peers.append(next(iter(matches.items())) if len(matches) == 1 else None)
        found[rank] = peers
    return found
