"""Will ASTRA-sim run these Chakra traces? Every rule of DESIGN.md's "ASTRA-sim rules", per file and
across ranks. Each problem is one line: `file: node N: what to fix`.

Reads any `.et` (ours, or mlc-chakra's converter output from real captures); a file that does not
decode is a UserError (exit 2), a trace that decodes but breaks a rule is a problem (exit 1).
"""
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import networkx as nx
from chakra.schema.protobuf import et_def_pb2 as et

from syntorch.chakra.rank_templates import RankTemplates
from syntorch.chakra.reader import find_traces, parse_nodes, read_bytes, split_header, split_messages
from syntorch.errors import UserError
from syntorch.userfiles import read_json

SIMULATED = {et.ALL_REDUCE, et.ALL_GATHER, et.ALL_TO_ALL, et.REDUCE_SCATTER, et.BROADCAST}
INT_FIELDS = {"int32_val", "int64_val", "uint32_val", "uint64_val", "sint32_val", "sint64_val",
              "fixed32_val", "fixed64_val", "sfixed32_val", "sfixed64_val"}
# attribute -> the value kinds ASTRA-sim's feeder accepts for it
ATTR_KINDS = {name: INT_FIELDS for name in ("comm_type", "comm_size", "num_ops", "tensor_size", "comm_priority")}
# mlcommons' et_feeder_node.cpp reads these with int32_val(): any other integer kind reads as 0 there
ATTR_KINDS.update(comm_src={"int32_val"}, comm_dst={"int32_val"}, comm_tag={"int32_val"})
ATTR_KINDS.update(pg_name={"string_val"}, is_cpu_op={"bool_val"} | INT_FIELDS, involved_dim={"bool_list"})
REQUIRED = {et.COMM_COLL_NODE: ("comm_type", "comm_size", "pg_name"),
            et.COMM_SEND_NODE: ("comm_dst", "comm_tag", "comm_size"),
            et.COMM_RECV_NODE: ("comm_src", "comm_tag", "comm_size")}
COMM_NODES = set(REQUIRED)
UNEQUAL_ALL_TO_ALL = ("ASTRA-sim matches an all-to-all's messages by size, so its members must move one size "
                      "(a skewed --moe_load gives EP ranks their own; CollectiveOrder)")


class Comm(NamedTuple):
    """What the checks across ranks read of a communication node (an integer attribute that is missing or
    not an integer is None; pg_name "" when missing or not a string: _check_node reports those)."""
    id: int
    type: int
    pg: str
    comm_type: int | None
    size: int | None
    src: int | None
    dst: int | None
    tag: int | None


def comm_of(node: et.Node) -> Comm:
    attrs = _attrs(node)
    pg = attrs["pg_name"].string_val if "pg_name" in attrs else ""
    return Comm(node.id, node.type, pg, *(_int_attr(attrs, name) for name in
                                          ("comm_type", "comm_size", "comm_src", "comm_dst", "comm_tag")))


@dataclass
class RankTrace:
    path: Path
    rank: int
    comms: list[Comm] = field(default_factory=list)  # its communication nodes, in file order

    def where(self, node=None) -> str:
        return f"{self.path.name}: node {node.id}" if node is not None else self.path.name


def validate_traces(path, comm_groups=None, roofline: bool = False) -> list[str]:
    """Problems (one line each) ASTRA-sim would hit with the traces at `path` (DIR or PREFIX), using
    `comm_groups` (a JSON file; default: comm_groups.json beside the traces). [] means it will run."""
    return check_traces(path, comm_groups, roofline)[0]


def check_traces(path, comm_groups=None, roofline: bool = False) -> tuple[list[str], int, int]:
    """(problems, ranks, nodes) for the traces at `path`; see validate_traces. Streams rank by rank: a rank's
    nodes are dropped once its own checks ran and its collectives were compared with its groups' first
    member, so memory holds one rank's nodes, one sequence per group and, per distinct file layout, the
    template ranks of the others are checked against (rank_templates.py), at any rank count."""
    files = find_traces(path)
    problems = []
    ranks = [r for r, _ in files]
    if ranks != list(range(len(ranks))):
        problems.append(f"{files[0][1].parent}: ranks {ranks[:8]} are not 0..{len(ranks) - 1}; "
                        "ASTRA-sim reads one file per NPU, <prefix>.0.et upward")
    groups_file = Path(comm_groups) if comm_groups else files[0][1].parent / "comm_groups.json"
    groups = load_comm_groups(groups_file, explicit=comm_groups is not None)
    for key, members in groups.items():
        if missing := [m for m in members if m not in ranks]:
            problems.append(f"{groups_file.name}: group {key} lists rank(s) {missing} that have no trace file")
    templates, node_checks = RankTemplates(), {}  # a node's bytes -> its problems
    order, p2p, total = CollectiveOrder(groups), PointToPoint(), 0
    for rank, f in files:
        data = read_bytes(f)
        header, start = split_header(data, f)
        found = templates.match(data, start, f)
        if found is None:  # decoded and checked whole: a template for the ranks after it
            _, body = split_messages(data, f)
            nodes = parse_nodes(body, f)
            checked = node_problems(nodes, groups, len(files), roofline, body, node_checks)
            comms = templates.add(body, nodes, checked, comm_of)
            mine, count = checked.flat(), len(nodes)
        else:  # its template's findings, with its own communication nodes checked again
            template, moved = found
            own = {i: [(node.id, p) for p in _checked(node, message, groups, len(files), roofline, node_checks)]
                   for i, (node, message) in moved.items()}
            comms = [comm_of(moved[i][0]) if i in moved else comm for i, comm in template.comms.items()]
            mine, count = template.problems.flat(own), template.count
        trace = RankTrace(f, rank, comms)
        if header is None:
            problems.append(f"{f.name}: does not start with a GlobalMetadata message; "
                            "write one before the nodes (else ASTRA-sim finds no dependency-free nodes)")
        problems += [f"{f.name}: node {node_id}: {text}" for node_id, text in mine]
        problems += check_rank_fields(trace, groups)
        problems += order.add(trace)
        p2p.add(trace)
        total += count
    return problems + p2p.finish(), len(files), total


def load_comm_groups(path: Path, explicit: bool) -> dict[str, list[int]]:
    if not path.is_file():
        if explicit:
            raise UserError(f"comm groups file {path} not found")
        return {}
    data = read_json(path, "comm groups file")
    if not isinstance(data, dict) or not all(
            re.fullmatch(r"\d+", k) and isinstance(v, list) and all(isinstance(r, int) for r in v)
            for k, v in data.items()):
        raise UserError(f"{path}: expected {{\"1\": [0, 1], ...}} (integer-string keys -> lists of ranks)")
    return data


def _attrs(node) -> dict:
    return {a.name: a for a in node.attr}


def _value(attr):
    return getattr(attr, attr.WhichOneof("value")) if attr.WhichOneof("value") else None


@dataclass
class NodeProblems:
    """What check_nodes finds, in its order: ids used twice, then per node (by index) the deps it names that
    the file lacks and its own checks, then a cycle. `flat(own)`: with some nodes' own checks replaced (a
    rank checked as its template but for those nodes, rank_templates.py)."""
    duplicates: list
    missing: dict  # node index -> [(node id, what to fix)]
    own: dict  # node index -> [(node id, what to fix)]
    cycles: list

    def flat(self, own: dict | None = None) -> list[tuple[int, str]]:
        mine = {**self.own, **(own or {})}
        out = list(self.duplicates)
        for i in sorted(self.missing.keys() | mine.keys()):
            out += self.missing.get(i, []) + mine.get(i, [])
        return out + self.cycles


def check_nodes(nodes: list[et.Node], groups: dict, world: int, roofline: bool = False,
                messages: list[bytes] | None = None, cache: dict | None = None) -> list[tuple[int, str]]:
    """Rules within one file that do not depend on its rank: unique ids, deps that exist, no cycle,
    node types and attributes. Returns (node id, what to fix) pairs. With the nodes' `messages`, a node's
    own checks are looked up in `cache` by its bytes (they depend on nothing else for one groups/world)."""
    return node_problems(nodes, groups, world, roofline, messages, cache).flat()


def node_problems(nodes, groups, world, roofline=False, messages=None, cache=None) -> NodeProblems:
    """check_nodes' findings by kind and node (NodeProblems)."""
    ids = Counter(n.id for n in nodes)
    duplicates = [(node_id, f"id used by {count} nodes; ids must be unique (ASTRA-sim keeps only the last)")
                  for node_id, count in ids.items() if count > 1]
    cache = {} if cache is None else cache
    missing, own = {}, {}
    for i, node in enumerate(nodes):
        lacking = [(node.id, f"{kind} names node {d}, which is not in this file")
                   for kind, deps in (("data_deps", node.data_deps), ("ctrl_deps", node.ctrl_deps))
                   for d in deps if d not in ids]
        found = _checked(node, messages[i] if messages else None, groups, world, roofline, cache)
        if lacking:
            missing[i] = lacking
        if found:
            own[i] = [(node.id, p) for p in found]
    return NodeProblems(duplicates, missing, own, _check_cycles(nodes))


def _checked(node, message: bytes | None, groups, world, roofline, cache: dict) -> list[str]:
    """_check_node's problems, looked up by the node's bytes when given."""
    found = cache.get(message) if message else None
    if found is None:
        found = _check_node(node, groups, world, roofline)
        if message:
            cache[message] = found
    return found


def check_rank_fields(trace: RankTrace, groups: dict) -> list[str]:
    """What depends on the file's rank: it issues collectives only of groups it is in, and a send's
    source (a recv's destination), when given, is itself (ASTRA-sim throws otherwise)."""
    problems = []
    for comm in trace.comms:
        if comm.type == et.COMM_COLL_NODE and comm.pg in groups and trace.rank not in groups[comm.pg]:
            problems.append(f"{trace.where(comm)}: rank {trace.rank} issues a collective of group {comm.pg} "
                            f"{groups[comm.pg]} without being in it")
        # a peer that is not an integer is reported by _check_node
        own, value = ("comm_src", comm.src) if comm.type == et.COMM_SEND_NODE else ("comm_dst", comm.dst)
        if comm.type != et.COMM_COLL_NODE and value is not None and value != trace.rank:
            problems.append(f"{trace.where(comm)}: {own} is {value} in rank {trace.rank}'s file; "
                            f"drop it or make it {trace.rank}")
    return problems


def _check_node(node, groups, world, roofline) -> list[str]:
    """The node's type and attributes."""
    if node.type in (et.METADATA_NODE, et.INVALID_NODE):
        return [f"{et.NodeType.Name(node.type)} is not allowed (ASTRA-sim aborts or stalls); "
                "drop it or make it a COMP_NODE"]
    problems = []
    attrs = _attrs(node)
    for name, attr in attrs.items():
        kind = attr.WhichOneof("value")
        if name in ATTR_KINDS and kind not in ATTR_KINDS[name]:
            want = ("a bool_list" if name == "involved_dim" else "a string_val" if name == "pg_name" else
                    "an int32_val (mlcommons' feeder reads it with int32_val(); other kinds read as 0)"
                    if ATTR_KINDS[name] == {"int32_val"} else "an integer")
            problems.append(f"attribute {name} {'has no value' if kind is None else f'is {kind}'}, must be {want}")
    if node.type == et.COMP_NODE and roofline:
        for name, why in (("num_ops", "its time would be 0/0"), ("tensor_size", "the node would be skipped")):
            value = _int_attr(attrs, name)
            if name not in attrs:
                problems.append(f"COMP_NODE needs {name} for roofline")
            elif value is not None and value <= 0:
                problems.append(f"{name} is {value}; under ASTRA-sim's roofline {why}: write a positive value")
    if node.type in COMM_NODES:
        problems += _check_comm(node, attrs, groups, world)
    return problems


def _check_comm(node, attrs, groups, world) -> list[str]:
    problems = [f"{et.NodeType.Name(node.type)} needs attribute {a}" for a in REQUIRED[node.type] if a not in attrs]
    if "is_cpu_op" in attrs and _value(attrs["is_cpu_op"]):
        problems.append("communication node with is_cpu_op true; ASTRA-sim rejects it: set it false")
    size = _int_attr(attrs, "comm_size")
    if size is not None and size <= 0:
        problems.append(f"comm_size is {size}; it must be the bytes moved, > 0")
    value = _int_attr(attrs, "comm_type")
    if node.type == et.COMM_COLL_NODE and value is not None:
        if value not in SIMULATED:
            name = et.CollectiveCommType.Name(value) if value in et.CollectiveCommType.values() else value
            problems.append(f"comm_type {name} throws in ASTRA-sim; express it as ALL_REDUCE, ALL_GATHER, "
                            "REDUCE_SCATTER, ALL_TO_ALL or send/recv")
    pg = attrs.get("pg_name")
    if pg is not None and pg.WhichOneof("value") == "string_val" and pg.string_val not in groups \
            and pg.string_val not in ("", "0"):
        problems.append(f"pg_name {pg.string_val!r} is not a key of the comm-group JSON; add the group there")
    for peer in ("comm_src", "comm_dst"):
        value = _int_attr(attrs, peer)
        if value is not None and not 0 <= value < world:
            problems.append(f"{peer} {value} is not a rank (0..{world - 1})")
    return problems


def _check_cycles(nodes: list[et.Node]) -> list[tuple[int, str]]:
    """Kahn's algorithm over data and ctrl deps; the nodes it cannot reach hold a cycle, found by networkx."""
    ids = {n.id for n in nodes}
    deps = {n.id: {d for d in (*n.data_deps, *n.ctrl_deps) if d in ids} for n in nodes}
    users = defaultdict(list)
    for node_id, ds in deps.items():
        for d in ds:
            users[d].append(node_id)
    waiting = {node_id: len(ds) for node_id, ds in deps.items()}
    ready = [node_id for node_id, count in waiting.items() if count == 0]
    while ready:
        for user in users[ready.pop()]:
            waiting[user] -= 1
            if waiting[user] == 0:
                ready.append(user)
    stuck = [node_id for node_id, count in waiting.items() if count > 0]
    if not stuck:
        return []
    cycle = nx.find_cycle(nx.DiGraph((d, n) for n in stuck for d in deps[n] if d in waiting and waiting[d] > 0))
    path = " -> ".join(str(u) for u, _ in cycle) + f" -> {cycle[0][0]}"
    return [(cycle[0][0], f"dependency cycle {path}; ASTRA-sim cannot start any of them")]


def _int_attr(attrs, name):
    attr = attrs.get(name)
    return _value(attr) if attr is not None and attr.WhichOneof("value") in INT_FIELDS else None


class CollectiveOrder:
    """Every member of a group issues its collectives in the same order, type and size (file order): each
    rank's sequence per group is compared, as it is read, with the group's first member's. An all-to-all too:
    ASTRA-sim's analytical backend matches each message of a collective by (tag, src, dst, size)
    (network_frontend/analytical/common/ChunkIdGenerator.cc), and its all-to-alls (ring and direct) send
    comm_size / members per step, so members of unequal sizes never meet: every rank stops there and the run
    ends with "has unreleased nodes", exit 0 (tried on an 8-rank skewed MoE trace, ASTRA-sim 518bd51)."""

    def __init__(self, groups: dict):
        self.member_of = defaultdict(list)  # rank -> the groups it is in ("0": every rank's)
        for pg, members in groups.items():
            for rank in members:
                self.member_of[rank].append(pg)
        self.reference = {}  # group -> (its first member, [(node id, comm_type, comm_size)])

    def add(self, trace: RankTrace) -> list[str]:
        issued = defaultdict(list)
        for comm in trace.comms:
            if comm.type == et.COMM_COLL_NODE:
                issued[comm.pg or "0"].append((comm.id, comm.comm_type, comm.size))
        problems = []  # a collective of a group the rank is not in: check_rank_fields says so
        for pg in ["0", *self.member_of[trace.rank]]:
            mine = issued.get(pg, [])
            if pg not in self.reference:
                self.reference[pg] = (trace.rank, mine)
            else:
                problems += _compare(trace, mine, *self.reference[pg], pg)
        return problems


class PointToPoint:
    """Every send has a recv on its peer with the same source, tag and size, and the other way round."""

    def __init__(self):
        self.sends, self.recvs = defaultdict(list), defaultdict(list)  # (src, dst, tag, size) -> [where]

    def add(self, trace: RankTrace) -> None:
        for comm in trace.comms:
            if comm.type == et.COMM_SEND_NODE:
                self.sends[(trace.rank, comm.dst, comm.tag, comm.size)].append(trace.where(comm))
            elif comm.type == et.COMM_RECV_NODE:
                self.recvs[(comm.src, trace.rank, comm.tag, comm.size)].append(trace.where(comm))

    def finish(self) -> list[str]:
        problems = []
        for key in self.sends.keys() | self.recvs.keys():
            src, dst, tag, size = (_shown(v, attr) for v, attr in zip(key, ("comm_src", "comm_dst", "comm_tag", "comm_size")))
            sends, recvs = self.sends[key], self.recvs[key]
            problems += [f"{where}: send to rank {dst} (tag {tag}, {size} B) has no matching recv on rank {dst}"
                         for where in sends[len(recvs):]]
            problems += [f"{where}: recv from rank {src} (tag {tag}, {size} B) has no matching send on rank {src}"
                         for where in recvs[len(sends):]]
        return problems


def _shown(value, attr: str) -> str:
    """An integer attribute's value in a message; `<no comm_size>` when it is missing or not an integer."""
    return f"<no {attr}>" if value is None else str(value)


def _describe(entry) -> str:
    _, comm_type, size = entry
    name = et.CollectiveCommType.Name(comm_type) if comm_type in et.CollectiveCommType.values() else comm_type
    return f"{_shown(name, 'comm_type')} of {_shown(size, 'comm_size')} B"


def _compare(trace, mine, ref_rank, ref, pg) -> list[str]:
    for i, (a, b) in enumerate(zip(mine, ref)):
        if a[1:] != b[1:]:
            fix = UNEQUAL_ALL_TO_ALL if a[1] == b[1] == et.ALL_TO_ALL else \
                "every member must issue the group's collectives in the same order"
            return [f"{trace.path.name}: node {a[0]}: collective #{i} of group {pg} is {_describe(a)} but rank "
                    f"{ref_rank} issues {_describe(b)}; {fix}"]
    if len(mine) != len(ref):
        return [f"{trace.where()}: issues {len(mine)} collectives in group {pg}, rank {ref_rank} issues "
                f"{len(ref)}; the run would hang waiting for the missing ones"]
    return []
