"""The one Chakra writer: `<prefix>.<rank>.et` per rank, `comm_groups.json`, and `tensor_trace_chakra.json`
(rank 0 in protobuf's JSON form, as `chakra_jsonizer` prints it). Messages are written with the official
mlc-chakra schema and protolib (length-delimited: one GlobalMetadata, then the nodes).

Two paths, one encoding:
- `write_chakra`: a graph per rank (ranks may share one graph, and then its encoding).
- `StageTemplate`: one stage's nodes serialized once as its representative rank's; any other rank of the
  stage is that with the group id of each communication node and the peer of each send/recv overwritten
  in place, the bytes of every rank computed at once (the cluster-scale workload writes thousands of ranks
  this way).
"""
import functools
import io
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import networkx as nx
import numpy as np
from chakra.schema.protobuf import et_def_pb2 as et
from chakra.src.third_party.utils.protolib import encodeMessage
from google.protobuf.json_format import MessageToDict

from syntorch.chakra.groups import comm_groups_json, graph_group_ids
from syntorch.chakra.nodes import NodeSpec, chakra_nodes, global_metadata, rewrite_notes, to_json, to_proto
from syntorch.errors import UserError
from syntorch.outdir import atomic_output_dir
from syntorch.parallel.mesh import Mesh
from syntorch.trace.graph import RankTraces, graph_kinds
from syntorch.trace import levels

JSON_FORM = "tensor_trace_chakra.json"
PER_RANK = ("pg_name", "comm_src", "comm_dst")  # the attributes that differ between ranks of a stage


@functools.cache  # a template asks for the length of each of its nodes: a few hundred distinct ones
def varint(n: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative integer (the length prefix of each message)."""
    out = bytearray()
    while True:
        out.append(n & 0x7F | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def serialize(specs: list[NodeSpec]) -> bytes:
    buf = io.BytesIO()
    for spec in specs:
        encodeMessage(buf, to_proto(spec))
    return buf.getvalue()


def write_json_form(path: Path, header: et.GlobalMetadata, specs: list[NodeSpec]) -> None:
    # chakra_jsonizer prints MessageToJson of each message back to back, which is not one JSON
    # document; we write the same objects as one: {"global_metadata": ..., "nodes": [...]}.
    # one encoder, not one per node (json.dumps makes one per call); dicts of strings and lists hold no cycles
    encode = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode
    with open(path, "w") as f:
        f.write('{"global_metadata": ' + json.dumps(MessageToDict(header)) + ',\n"nodes": [\n')
        f.write(",\n".join([encode(to_json(spec)) for spec in specs]))
        f.write("\n]}\n")


def chakra_level(graph, level: str):
    """The graph at a level Chakra takes: every op, or one node per module."""
    if level not in ("op", "module"):
        raise UserError(f"Chakra traces are written at level op or module, not {level!r}")
    return graph if level == "op" else levels.level_view(graph, "module")


def write_chakra(graphs_by_rank: Mapping[int, nx.DiGraph], out_dir, model_name: str | None = None,
                 level: str = "op", force: bool = False, json_name: str = JSON_FORM, flag: str = "--output",
                 p2p_all_to_all: bool = False) -> dict:
    """Writes `<model>.<rank>.et` for every rank, `comm_groups.json` and the JSON form of rank 0
    (`json_name`) into `out_dir`, whole or not at all, by syntorch.outdir's policy (`flag` names the folder
    in its messages); `p2p_all_to_all`: chakra_nodes'. Returns a summary (files, nodes, bytes, notes)."""
    ranks = sorted(graphs_by_rank)
    if ranks != list(range(len(ranks))) or not ranks:
        raise UserError(f"Chakra needs one graph per rank 0..N-1, got ranks {ranks[:8]}")
    out_dir = Path(out_dir)
    model = re.sub(r"[^\w.+-]", "_", model_name or graphs_by_rank[0].graph.get("model") or "trace")  # a file name
    # one level view and one encoding per distinct graph, which the ranks sharing it share
    kinds = graph_kinds(graphs_by_rank)
    distinct = [chakra_level(graph, level) for graph, _ in kinds]
    kind_of = {r: k for k, (_, kind_ranks) in enumerate(kinds) for r in kind_ranks}
    groups, notes = graph_group_ids(distinct), rewrite_notes(distinct)
    encoded, total = {}, 0  # kind -> (node bytes, node count, has durations)
    with atomic_output_dir(out_dir, force, flag) as tmp:
        for rank in ranks:
            graph, key = graphs_by_rank[rank], kind_of[rank]
            if key not in encoded:
                specs = chakra_nodes(distinct[key], groups, p2p_all_to_all)
                encoded[key] = (serialize(specs), len(specs), any(s.duration_micros for s in specs))
                if rank == 0:
                    write_json_form(tmp / json_name, global_metadata(graph, model, level, notes, encoded[key][2]), specs)
                del specs
            body, _, durations = encoded[key]
            path = tmp / f"{model}.{rank}.et"
            with open(path, "wb") as f:
                encodeMessage(f, global_metadata(graph, model, level, notes, durations))
                f.write(body)
            total += path.stat().st_size
        (tmp / "comm_groups.json").write_text(comm_groups_json(groups))
    return {"dir": str(out_dir), "prefix": str(out_dir / model), "ranks": len(ranks),
            "distinct_traces": len(encoded), "nodes": sum(n for _, n, _ in encoded.values()),
            "et_bytes": total, "groups": len(groups), "notes": notes}


def export(graph: nx.DiGraph, path, level: str = "op", force: bool = False) -> dict:
    """`syntorch export --format chakra`: a saved graph into the folder `path`, or, for `path` ending in
    .json (seed 000: `--output model.json`), the JSON form there and the .et files beside it. A
    tensor-parallel graph stands for every rank (TP ranks run the same ops), so it is written per rank."""
    world, tp = graph.graph.get("world_size", 1), graph.graph.get("tp", 1)
    if world != tp:
        raise UserError(f"this graph is one rank of a {world}-rank run that is not pure TP; "
                        "write per-rank traces with `syntorch trace` instead")
    ranks = RankTraces(world)
    ranks.put_shared(range(world), lambda: graph)
    path = Path(path)
    if path.suffix == ".json":
        return write_chakra(ranks, path.parent, level=level, force=force, json_name=path.name, flag="--output's folder")
    return write_chakra(ranks, path, level=level, force=force)


# -- the fast per-rank path ------------------------------------------------------------------------------

_ATTR_FIELD = et.Node.DESCRIPTOR.fields_by_name["attr"].number
_INT32_FIELD = et.AttributeProto.DESCRIPTOR.fields_by_name["int32_val"].number
PEER_BYTES = 5  # a rank as a 5-byte varint: protobuf reads non-minimal varints, so every rank fits the same bytes


def _padded_varint(n: int) -> bytes:
    return bytes([(n >> 7 * i) & 0x7F | 0x80 for i in range(PEER_BYTES - 1)] + [n >> 7 * (PEER_BYTES - 1)])


def _attr_piece(name: str, value) -> bytes:
    """A Node holding only this attribute, serialized (a repeated `attr` may come in pieces); a peer's
    int32_val is padded to PEER_BYTES, last in the piece."""
    if name == "pg_name":
        return et.Node(attr=[et.AttributeProto(name=name, string_val=value)]).SerializeToString()
    attr = et.AttributeProto(name=name).SerializeToString() + varint(_INT32_FIELD << 3) + _padded_varint(value)
    return varint(_ATTR_FIELD << 3 | 2) + varint(len(attr)) + attr


def _attr_bytes(attrs: list) -> tuple[bytes, list[tuple[int, str, object]]]:
    """A node's `attr` entries serialized as the template has them: those every rank shares, then the
    per-rank ones (_attr_piece); and where each per-rank value starts in those bytes, with its name and value."""
    shared = et.Node(attr=[et.AttributeProto(name=name, **{field: value}) for name, field, value in attrs
                           if name not in PER_RANK]).SerializeToString()
    out, per_rank = [shared], []
    for name, _, value in attrs:
        if name in PER_RANK:
            out.append(_attr_piece(name, value))
            end = sum(map(len, out))
            per_rank.append((end - (len(value) if name == "pg_name" else PEER_BYTES), name, value))
    return b"".join(out), per_rank


def _cached(attrs_of: dict, attrs: list) -> tuple:
    """_attr_bytes(attrs), made once per distinct list."""
    key = tuple(attrs)
    if key not in attrs_of:
        attrs_of[key] = _attr_bytes(attrs)
    return attrs_of[key]


class GroupIds:
    """The comm-group ids of a mesh's groups (chakra/groups.py) as the stage templates of a run look them up:
    by their text in a node, and by the group a representative's group moves to for another rank (cached
    by line, shared by the templates of every stage)."""

    def __init__(self, ids: dict[tuple, int], mesh: Mesh):
        self.ids, self.mesh, self._lines, self._line_of = ids, mesh, {}, {}
        self.by_text = {str(i): g for g, i in ids.items()}
        self.width = len(str(next(iter(ids.values())))) if ids else 0  # every id's (groups.py)

    def line_of(self, group: tuple) -> tuple | None:
        """The mesh dimensions `group` spans and their (size, stride) lines when it is a whole line along them
        (Mesh.dims_of: every mesh group is), else None. Asked once per group (the world's 16,384 ranks included)."""
        if group not in self._line_of:
            names = self.mesh.dims_of(group)
            self._line_of[group] = (names, self.mesh.lines(*names)) if len(group) == self.mesh.size(*names) else None
        return self._line_of[group]

    def moved(self, group: tuple, line: tuple | None, by: int) -> int:
        """The id of the group that plays, for the rank `by` moves the representative to (Mesh.translate), the
        part `group` plays for the representative; `line`: line_of(group). Translation moves a whole line to
        the line through its first member moved, known by that line's lowest rank (Mesh.first): a 128-rank
        DP group is translated and sorted once per line, not once per rank of every stage."""
        key = None
        if line is not None:
            first = self.mesh.translate(group[0], by)
            key = line[0], first - sum(first // stride % size * stride for size, stride in line[1])
        if key not in self._lines:
            found = self.ids[tuple(sorted(self.mesh.translate(r, by) for r in group))]
            if key is None:
                return found
            self._lines[key] = found
        return self._lines[key]


class StageTemplate:
    """One stage's Chakra nodes serialized once, as its representative's (dp 0, cp 0, tp 0); `write(prefix, ranks)`
    writes any of the stage's ranks by overwriting what differs: the group id in each
    communication node's `pg_name` (fixed width, see groups.py) and the peer of each send and recv.
    Those attributes are appended to the node's other bytes, so their values sit at known offsets.
    `origin`: the rank whose nodes they are, when not the representative (a rank kind's, moe_load.RankKinds):
    the ranks written from it are moved from there."""

    def __init__(self, specs: list[NodeSpec], header: et.GlobalMetadata, groups: GroupIds, origin: int = 0):
        self.groups, self.mesh, self.origin = groups, groups.mesh, origin
        self.header = header.SerializeToString()  # without `rank`, appended per rank the same way
        group_at: dict[tuple, list[int]] = {}  # representative's group -> offsets of its id in the body
        peer_at, self.peers = [], []  # offsets of the padded peers, and the representative's peers
        chunks, size, attrs_of, of_list = [], 0, {}, {}
        for spec in specs:
            head = to_proto(spec, attrs=False).SerializeToString()
            # a stage's nodes have ~100 distinct lists of attributes, most shared by chakra_nodes (ops of equal
            # attributes have one list): looked up by the list first, by its values once per list
            found = of_list.get(id(spec.attrs))  # (specs keeps every list alive: ids are not reused)
            if found is None:
                found = of_list[id(spec.attrs)] = _cached(attrs_of, spec.attrs)
            tail, per_rank = found
            prefix = varint(len(head) + len(tail))
            at = size + len(prefix) + len(head)
            for offset, name, value in per_rank:
                if name == "pg_name":
                    group_at.setdefault(groups.by_text[value], []).append(at + offset)
                else:
                    peer_at.append(at + offset)
                    self.peers.append(value)
            chunks += (prefix, head, tail)
            size = at + len(tail)
        self.body = np.frombuffer(bytearray(b"".join(chunks)), dtype=np.uint8)  # writable: patched per rank
        self.group_list, self.counts = list(group_at), [len(at) for at in group_at.values()]
        self.lines = [groups.line_of(g) for g in group_at]  # in group_list's order
        # the offset of every byte a rank patches, in the order _patches lists them: each group's ids, then the peers
        self.sites = np.concatenate([_bytes_at(at, groups.width) for at in group_at.values()]
                                    + [_bytes_at(peer_at, PEER_BYTES)])

    def write(self, prefix: str, ranks: list[int]) -> tuple[int, int]:
        """Writes the files `<prefix>.<rank>.et` of `ranks`; returns the bytes written and how many of the files
        differ (ranks whose group ids and peers are equal have equal nodes)."""
        patches, total = self._patches(ranks), 0
        for rank, patch in zip(ranks, patches):
            rank_attr = et.GlobalMetadata(attr=[et.AttributeProto(name="rank", int64_val=rank)]).SerializeToString()
            head = varint(len(self.header) + len(rank_attr)) + self.header + rank_attr
            # patched in place, not in a copy (a fresh 100+ KB buffer per rank cost a memcpy and its page faults)
            self.body[self.sites] = patch
            total += _write_file(f"{prefix}.{rank}.et", [head, self.body.data])  # (not pathlib: 16,384 paths)
        return total, len({patch.tobytes() for patch in patches})

    def _patches(self, ranks: list[int]) -> np.ndarray:
        """Each rank's bytes at `sites`, a row per rank: its group ids, each as often as it stands in the body,
        then its peers, padded."""
        moves = np.array([self.mesh.translate(rank, self.origin, back=True) for rank in ranks])  # origin -> rank
        rows = []
        for group, line, count in zip(self.group_list, self.lines, self.counts):
            if line is None:  # not a whole line (a send's pair): each rank's own group, its members moved
                members = np.sort(self._moved(group, moves), axis=1).tolist()
                ids = np.array([self.groups.ids[tuple(m)] for m in members])
            else:  # the moves that take the group to one line differ only along the line: a lookup per line
                keys = moves - sum(moves // stride % size * stride for size, stride in line[1])
                _, first, where = np.unique(keys, return_index=True, return_inverse=True)
                ids = np.array([self.groups.moved(group, line, by) for by in moves[first].tolist()])[where]
            digits = ids[:, None] // 10 ** np.arange(self.groups.width - 1, -1, -1) % 10 + ord("0")
            rows.append(np.tile(digits.astype(np.uint8), count))
        peers = self._moved(self.peers, moves)[:, :, None]
        rows.append((peers >> 7 * np.arange(PEER_BYTES) & 0x7F | _CONTINUED).astype(np.uint8))
        return np.concatenate([row.reshape(len(ranks), -1) for row in rows], axis=1)

    def _moved(self, ranks: list[int], moves: np.ndarray) -> np.ndarray:
        """`ranks` moved by each of `moves` (Mesh.translate's arithmetic takes an array of them): a row per move."""
        moved = [self.mesh.translate(rank, moves) for rank in ranks]
        return np.array(moved, dtype=np.int64).reshape(len(ranks), len(moves)).T


_CONTINUED = np.array([0x80] * (PEER_BYTES - 1) + [0])  # the continuation bits of a padded varint's bytes


def _write_file(path: str, parts: list) -> int:
    """`open(path, "wb")` and a write of `parts`, in 3 system calls (a file object makes 7); returns the bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        size, written = sum(map(len, parts)), os.writev(fd, parts)
        rest = memoryview(b"".join(parts))[written:] if written < size else b""
        while rest:  # after a short write (a full disk), the rest: its write says why it cannot
            rest = rest[os.write(fd, rest):]
        return size
    finally:
        os.close(fd)


def _bytes_at(starts: list[int], width: int) -> np.ndarray:
    """The offsets of `width` bytes from each of `starts`, in order."""
    return (np.array(starts, dtype=np.int64)[:, None] + np.arange(width)).ravel()
