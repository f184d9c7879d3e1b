"""Chakra files of a symbolic TP x PP inference run, one encoding per pipeline stage.

A rank's graph is its stage representative's with every collective's group and peers moved along tp
(trace/generation.py's `translated`), so its file is the representative's but for each communication node's
`pg_name`, `comm_src` and `comm_dst`, and the header's rank. Each stage's representative is encoded once, as
writer.write_chakra encodes it; every rank of the stage gets those bytes with its own values encoded in those
attributes (and its nodes' lengths), so the files equal write_chakra's byte for byte (tests/test_stage_files.py)
and no rank's graph is built. With durations (--hw_config), each rank's collectives were costed on its own
graph: the stage's encoding stands for it only where they took its representative's (`same_durations`);
otherwise the run is written rank by rank (write_chakra).
"""
import io
import re
import types
from pathlib import Path

from chakra.schema.protobuf import et_def_pb2 as et
from chakra.src.third_party.utils.protolib import encodeMessage

from syntorch.chakra.groups import comm_groups_json, group_ids
from syntorch.chakra.nodes import NodeSpec, chakra_nodes, global_metadata, rewrite_notes, to_proto
from syntorch.chakra.writer import JSON_FORM, PER_RANK, chakra_level, varint, write_json_form
from syntorch.outdir import atomic_output_dir

_ATTR_TAG = varint(et.Node.DESCRIPTOR.fields_by_name["attr"].number << 3 | 2)  # a length-delimited `attr` entry


def write_stage_chakra(traces, out_dir, level: str = "op") -> dict:
    """write_chakra(traces, out_dir, level=level)'s files and summary for generation.StageTraces."""
    mesh = traces.mesh
    graphs = [traces.stage_graph(stage) for stage in range(mesh.pp)]
    views = [chakra_level(graph, level) for graph in graphs]
    groups = group_ids(_rank_groups(views, mesh))
    notes = rewrite_notes(views)
    model = re.sub(r"[^\w.+-]", "_", graphs[0].graph.get("model") or "trace")  # write_chakra's file name
    total = nodes = 0
    with atomic_output_dir(out_dir, False, "--output") as tmp:
        for stage, (graph, view) in enumerate(zip(graphs, views)):
            specs = chakra_nodes(view, groups)
            durations = any(s.duration_micros for s in specs)
            if stage == 0:  # rank 0 is stage 0's representative
                write_json_form(tmp / JSON_FORM, global_metadata(graph, model, level, notes, durations), specs)
            encoding = StageEncoding(specs, groups, mesh)
            for rank in mesh.stage_ranks(stage):
                as_rank = types.SimpleNamespace(graph={**graph.graph, "rank": rank})
                path = tmp / f"{model}.{rank}.et"
                with open(path, "wb") as f:
                    encodeMessage(f, global_metadata(as_rank, model, level, notes, durations))
                    f.write(encoding.body(rank))
                total += path.stat().st_size
                nodes += len(specs)
        (tmp / "comm_groups.json").write_text(comm_groups_json(groups))
    # every rank's graph is its own (a translation), as write_chakra counts distinct traces
    return {"dir": str(out_dir), "prefix": str(Path(out_dir) / model), "ranks": mesh.world_size,
            "distinct_traces": mesh.world_size, "nodes": nodes, "et_bytes": total, "groups": len(groups),
            "notes": notes}


def same_durations(traces) -> bool:
    """Whether every rank's collectives took its stage representative's durations (its other nodes are the
    representative's own)."""
    mesh = traces.mesh
    for stage in range(mesh.pp):
        graph = traces.stage_graph(stage)
        ids = [n for n, _ in graph.collectives()]
        want = [graph.node_attrs[n].get("duration_us") for n in ids]
        for rank in mesh.stage_ranks(stage):
            nodes = traces[rank].node_attrs
            if [nodes[n].get("duration_us") for n in ids] != want:
                return False
    return True


def _rank_groups(views, mesh):
    """Every rank's collective groups in rank order, each rank's in first use (what write_chakra numbers)."""
    for rank in range(mesh.world_size):
        view = views[mesh.coordinate(rank).pp]
        for group in dict.fromkeys(tuple(d["group"]) for _, d in view.collectives()):
            yield [mesh.translate(r, rank) for r in group]


class StageEncoding:
    """A stage representative's serialized nodes, as runs of bytes every rank shares between the
    communication nodes, which are encoded for each rank from their other attributes' bytes."""

    def __init__(self, specs: list[NodeSpec], groups: dict[tuple, int], mesh):
        self.groups, self.mesh = groups, mesh
        self.group_of = {str(i): g for g, i in groups.items()}
        self.parts: list[bytes | tuple] = []  # bytes, or (node without attrs, attrs as bytes or per-rank triples)
        self._pieces: dict[tuple, bytes] = {}
        run = io.BytesIO()
        for spec in specs:
            if not any(name in PER_RANK for name, _, _ in spec.attrs):
                encodeMessage(run, to_proto(spec))
                continue
            self.parts.append(run.getvalue())
            run = io.BytesIO()
            head = to_proto(spec._replace(attrs=[])).SerializeToString()
            self.parts.append((head, [a if a[0] in PER_RANK else self._piece(*a) for a in spec.attrs]))
        self.parts.append(run.getvalue())

    def body(self, rank: int) -> bytes:
        """The nodes of `rank`'s file: its groups' ids and its peers in the communication nodes."""
        moved: dict[tuple, bytes] = {}  # a representative's attribute -> rank's, encoded

        def encoded(attr) -> bytes:
            if attr not in moved:
                moved[attr] = self._piece(*self._for_rank(attr, rank))
            return moved[attr]

        out = []
        for part in self.parts:
            if isinstance(part, bytes):
                out.append(part)
                continue
            head, attrs = part
            data = head + b"".join(a if isinstance(a, bytes) else encoded(a) for a in attrs)
            out += (varint(len(data)), data)
        return b"".join(out)

    def _for_rank(self, attr: tuple, rank: int) -> tuple:
        name, field, value = attr
        if name == "pg_name":
            group = sorted(self.mesh.translate(r, rank) for r in self.group_of[value])
            return name, field, str(self.groups[tuple(group)])
        return name, field, self.mesh.translate(value, rank)

    def _piece(self, name: str, field: str, value) -> bytes:
        """The bytes of one `attr` entry of a Node (a repeated field is its entries back to back)."""
        key = (name, field, value)
        if key not in self._pieces:
            attr = et.AttributeProto(name=name, **{field: value}).SerializeToString()
            self._pieces[key] = _ATTR_TAG + varint(len(attr)) + attr
        return self._pieces[key]
