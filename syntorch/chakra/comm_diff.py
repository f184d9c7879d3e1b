"""The communication of two Chakra trace folders side by side, rank by rank: a captured run (`syntorch train
--enable-tracing`) and the symbolic trace of the same plan (`syntorch trace`), or any two traces.

Per rank, the communication nodes in issue order (node id order: traced order in syntorch's files, the
host trace's order in a capture) are lined up (difflib's longest matching blocks): collectives by their
type, bytes (comm_size) and group, the group as its set of global ranks (each folder's comm_groups.json;
pg_name "0" or "" is every rank), sends and recvs by peer and bytes. Node names, ids, tags, group ids and
compute nodes are not compared. Each difference is one line: the rank, the position in the rank's
communication sequence and what differs.

One thing is compared on the group rather than the rank: a variable all-to-all's bytes (MoE dispatch and
combine) follow where the router sent the real tokens, while the symbolic trace routes evenly. What the
group moves in total is the same either way (every row sent is received once), so an all-to-all is lined
up by type and group, and the k-th all-to-all of a group must move the same bytes summed over its members.

Nothing is filtered: both sides hold the profiled training step only (the capture's window is the
optimizer step; its logging, evaluation and set-up collectives fall outside it).
"""
import difflib
from collections import defaultdict
from typing import NamedTuple

from chakra.schema.protobuf import et_def_pb2 as et

from syntorch.chakra.reader import find_traces, read_trace
from syntorch.chakra.validator import load_comm_groups
from syntorch.errors import UserError

P2P_KINDS = {et.COMM_SEND_NODE: ("send", "comm_dst"), et.COMM_RECV_NODE: ("recv", "comm_src")}
ROUTED = "all_to_all"  # bytes per rank follow the routing: compared per group (module docstring)


class Comm(NamedTuple):
    """One communication node as compared: `peer` for send/recv, `group` (sorted global ranks) otherwise."""
    kind: str
    nbytes: int
    group: tuple[int, ...] = ()
    peer: int | None = None

    def key(self) -> tuple:
        """What must be equal for two nodes to line up."""
        return (self.kind, None if self.kind == ROUTED else self.nbytes, self.group, self.peer)

    def __str__(self) -> str:
        where = f"over {list(self.group)}" if self.peer is None else \
            f"{'to' if self.kind == 'send' else 'from'} rank {self.peer}"
        return f"{self.kind} of {self.nbytes} B {where}"


def read_comms(path) -> dict[int, list[Comm]]:
    """rank -> its communication in issue order, for the traces at `path` (DIR or PREFIX) and the
    comm_groups.json beside them."""
    files = find_traces(path)
    groups = load_comm_groups(files[0][1].parent / "comm_groups.json", explicit=False)
    world = tuple(range(len(files)))
    return {rank: [_comm(node, groups, world, f) for node in sorted(read_trace(f)[1], key=lambda n: n.id)
                   if node.type in (et.COMM_COLL_NODE, *P2P_KINDS)]
            for rank, f in files}


def _comm(node, groups: dict, world: tuple, path) -> Comm:
    attrs = {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr if a.WhichOneof("value")}
    if "comm_size" not in attrs:
        raise UserError(f"{path}: node {node.id} ({node.name}) has no comm_size; not a Chakra communication node")
    if node.type in P2P_KINDS:
        kind, peer = P2P_KINDS[node.type]
        if peer not in attrs:
            raise UserError(f"{path}: {kind} node {node.id} has no {peer}")
        return Comm(kind, attrs["comm_size"], peer=attrs[peer])
    pg = attrs.get("pg_name", "")
    if pg not in ("", "0") and pg not in groups:
        raise UserError(f"{path}: node {node.id} names process group {pg!r}, which comm_groups.json beside it "
                        "does not list")
    kind = et.CollectiveCommType.Name(attrs.get("comm_type", 0)).lower()
    return Comm(kind, attrs["comm_size"], tuple(sorted(groups[pg])) if pg in groups else world)


def compare(real, traced, names=("real", "traced")) -> tuple[list[str], dict]:
    """(differences, one line each; counts) between the traces at `real` and `traced`."""
    a, b = read_comms(real), read_comms(traced)
    if sorted(a) != sorted(b):
        return [f"ranks: {names[0]} has {len(a)}, {names[1]} has {len(b)}"], {}
    lines = [line for rank in sorted(a) for line in diff_rank(rank, a[rank], b[rank], names)]
    lines += diff_routed_totals(a, b, names)
    counts = {"ranks": len(a), "collectives": sum(c.peer is None for comms in a.values() for c in comms),
              "p2p": sum(c.peer is not None for comms in a.values() for c in comms)}
    return lines, counts


def diff_rank(rank: int, a: list[Comm], b: list[Comm], names) -> list[str]:
    """One line per difference between one rank's two sequences; positions count from 0 in `a`."""
    matcher = difflib.SequenceMatcher(None, [c.key() for c in a], [c.key() for c in b], autojunk=False)
    lines = []
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        if op == "replace" and i2 - i1 == j2 - j1:  # the same number on both sides: position by position
            lines += [f"rank {rank} #{i1 + k}: {_what_differs(a[i1 + k], b[j1 + k], names)}" for k in range(i2 - i1)]
            continue
        lines += [f"rank {rank} #{i}: {a[i]} only in {names[0]}" for i in range(i1, i2)]
        lines += [f"rank {rank} #{i1}: {b[j]} only in {names[1]} (its #{j})" for j in range(j1, j2)]
    return lines


def _what_differs(x: Comm, y: Comm, names) -> str:
    fields = [("kind", "type"), ("nbytes", "bytes"), ("group", "group"), ("peer", "peer")]
    changed = [f"{label} {_shown(getattr(x, f))} in {names[0]}, {_shown(getattr(y, f))} in {names[1]}"
               for f, label in fields
               if getattr(x, f) != getattr(y, f) and not (f == "nbytes" and x.kind == y.kind == ROUTED)]
    return f"{x}: {'; '.join(changed)}"


def _shown(value) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def diff_routed_totals(a: dict, b: dict, names) -> list[str]:
    """The k-th all-to-all of each group must move the same bytes over the group's members on both sides."""
    totals_a, totals_b = _routed_totals(a), _routed_totals(b)
    lines = []
    for group in sorted(totals_a.keys() & totals_b.keys()):
        for k, (x, y) in enumerate(zip(totals_a[group], totals_b[group])):
            if x != y:
                lines.append(f"group {list(group)} {ROUTED} #{k}: {x} B over the group in {names[0]}, "
                             f"{y} B in {names[1]}")
    return lines


def _routed_totals(comms: dict[int, list[Comm]]) -> dict[tuple, list[int]]:
    """group -> the bytes of its k-th all-to-all summed over the members that issued one."""
    totals = defaultdict(list)
    for rank_comms in comms.values():
        seen = defaultdict(int)
        for c in rank_comms:
            if c.kind == ROUTED:
                k, seen[c.group] = seen[c.group], seen[c.group] + 1
                column = totals[c.group]
                column.extend([0] * (k + 1 - len(column)))
                column[k] += c.nbytes
    return dict(totals)
