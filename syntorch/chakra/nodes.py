"""A TraceGraph as Chakra nodes: the one mapping every Chakra writer uses (chakra/writer.py).

Built on the official mlc-chakra schema. The rules followed here are DESIGN.md's "ASTRA-sim rules";
chakra/validator.py checks them on the files.

Graph -> Chakra:
- op -> COMP_NODE (num_ops, tensor_size, duration_micros, is_cpu_op=false); views and ops that move no
  bytes are folded away: their consumers depend on whatever they depended on.
- collective -> COMM_COLL_NODE (comm_type, comm_size, pg_name), send/recv -> COMM_SEND/RECV_NODE with
  comm_src/comm_dst/comm_tag as int32_val: mlcommons' et_feeder_node.cpp reads them with int32_val() (any
  other integer kind reads as 0 there). A skewed MoE load's all-to-all (its members move unequal bytes) is
  its sends and recvs, one pair of each per other member, with the bytes the tracer saw (_p2p_parts).
- data_deps: op -> tensor -> op in the graph; ctrl_deps: the previous communication node of the same
  channel, as NCCL runs one stream per communicator: a process group's collectives are ordered among
  themselves (every member issues them in one order, or the run hangs), never behind another group's, so a
  DP bucket's all-reduce can run beside TP and pipeline traffic. Send/recv between one pair of ranks are a
  channel of their own, in traced order, shared with a group of the same two ranks. ASTRA-sim (mlcommons) runs one communication at a time per NPU,
  the ready one with the lowest id (traced order); the members of a TP, DP or CP group run one stage's
  program and come to their ready nodes alike, so none holds its slot for a collective its peers put off.
"""
import math
from collections.abc import Mapping
from typing import NamedTuple

import networkx as nx
from chakra.schema.protobuf import et_def_pb2 as et

from syntorch.errors import UserError


def _part(nbytes: int, n: int) -> int:
    return math.ceil(nbytes / n)


# graph collective -> (Chakra comm type, comm_size from the graph's bytes and the group size, note when
# rewritten). The graph's bytes are the larger buffer (nccl-tests' size); ASTRA-sim's comm_size is the
# whole buffer for all-reduce, reduce-scatter and all-to-all, but each rank's part for all-gather (its
# ring sends comm_size per step and ends with n times it). ASTRA-sim throws on barrier, reduce, gather
# and scatter, and only replays broadcast's duration, so those become collectives it simulates.
COLLECTIVE_TYPES = {
    "all_reduce": (et.ALL_REDUCE, lambda b, n: b, None),
    "reduce_scatter": (et.REDUCE_SCATTER, lambda b, n: b, None),
    "all_to_all": (et.ALL_TO_ALL, lambda b, n: b, None),
    "all_gather": (et.ALL_GATHER, _part, None),
    "broadcast": (et.ALL_GATHER, _part, "broadcast written as all_gather of bytes/n per rank (same result, same ring traffic)"),
    "barrier": (et.ALL_REDUCE, lambda b, n: 4, "barrier written as a 4-byte all_reduce, as NCCL runs it"),
    "reduce": (et.ALL_REDUCE, lambda b, n: b, "reduce written as all_reduce of the same bytes"),
    "gather": (et.ALL_GATHER, _part, "gather written as all_gather (every rank gets what the root would)"),
    "scatter": (et.ALL_GATHER, _part, "scatter written as all_gather of each rank's part"),
}
P2P = {"send": et.COMM_SEND_NODE, "recv": et.COMM_RECV_NODE}
SCHEMA_VERSION = "0.0.4"  # the Chakra part of the ET schema tag mlc-chakra 1.0.0 reads ("1.0.2-chakra.0.0.4")


def rewrite_notes(graphs) -> list[str]:
    """What the files say about collectives written as others (e.g. broadcast as all_gather)."""
    notes = {COLLECTIVE_TYPES[d["collective"]][2] for g in graphs for _, d in g.collectives()
             if d["collective"] in COLLECTIVE_TYPES}
    return sorted(n for n in notes if n)


def _folded(data: dict) -> bool:
    return data["kind"] == "op" and (data.get("is_view") or (
        data["flops"] == 0 and data["bytes_read"] + data["bytes_written"] == 0 and not data.get("duration_us")))


class NodeSpec(NamedTuple):
    """One Chakra node as plain values: cheap to build, then turned into the protobuf (to_proto) and,
    for the readable JSON, into protobuf's JSON mapping (to_json) without a slow round trip."""
    id: int
    name: str
    type: int
    data_deps: list[int]
    ctrl_deps: list[int]
    duration_micros: int
    inputs: tuple[str, str, str]  # IOInfo values (tensor ids), shapes, types, each a JSON list
    outputs: tuple[str, str, str]
    attrs: list[tuple[str, str, object]]  # (name, AttributeProto value field, value)


def to_proto(spec: NodeSpec, attrs: bool = True) -> et.Node:
    """`attrs`: False leaves them out (attr is a Node's last field: writer.StageTemplate appends them)."""
    # fields set one by one: upb's constructor takes ~1 µs more for each repeated or message field it is given
    # (an empty list too) than an extend or an assignment does, ~40% of a template's serialization
    node = et.Node(id=spec.id, name=spec.name, type=spec.type, duration_micros=spec.duration_micros)
    node.data_deps.extend(spec.data_deps)
    if spec.ctrl_deps:
        node.ctrl_deps.extend(spec.ctrl_deps)
    inputs, outputs = node.inputs, node.outputs
    inputs.values, inputs.shapes, inputs.types = spec.inputs
    outputs.values, outputs.shapes, outputs.types = spec.outputs
    if attrs:
        node.attr.extend([et.AttributeProto(name=name, **{field: value}) for name, field, value in spec.attrs])
    return node


_JSON_FIELD = {"int32_val": "int32Val", "int64_val": "int64Val", "uint64_val": "uint64Val", "bool_val": "boolVal", "string_val": "stringVal"}


def to_json(spec: NodeSpec) -> dict:
    """What google.protobuf.json_format.MessageToDict gives for to_proto(spec) (tested): defaults left out,
    64-bit integers as strings (32-bit ones as numbers), enums by name."""
    def io(values):
        return {k: v for k, v in zip(("values", "shapes", "types"), values) if v}

    out = {"id": str(spec.id), "name": spec.name, "type": et.NodeType.Name(spec.type),
           "ctrlDeps": [str(d) for d in spec.ctrl_deps], "dataDeps": [str(d) for d in spec.data_deps],
           "durationMicros": str(spec.duration_micros), "inputs": io(spec.inputs), "outputs": io(spec.outputs),
           "attr": [{"name": name, _JSON_FIELD[field]: str(value) if field in ("int64_val", "uint64_val") else value}
                    for name, field, value in spec.attrs]}
    return {k: v for k, v in out.items() if v not in ("0", "", [])}


def collective_attrs(kind: str, nbytes: int, group_size: int, pg_name: str) -> tuple[int, list]:
    """(node type, attributes) of a collective `kind` over `group_size` ranks; `nbytes` as the graph counts
    them (the larger buffer, nccl-tests' size). Real captures go through here too (capture/repair.py)."""
    if kind not in COLLECTIVE_TYPES:
        raise UserError(f"collective {kind!r} has no Chakra form; use one of {', '.join([*COLLECTIVE_TYPES, *P2P])}")
    comm_type, size_of, _ = COLLECTIVE_TYPES[kind]
    return et.COMM_COLL_NODE, [("comm_type", "int64_val", comm_type),
                               ("comm_size", "int64_val", max(size_of(nbytes, group_size), 1)),
                               ("pg_name", "string_val", pg_name)]


def _comm_attrs(data: dict, pg_name: str) -> tuple[int, list]:
    kind = data["collective"]
    if kind in P2P:
        peer = ("comm_dst", data["dst"]) if kind == "send" else ("comm_src", data["src"])
        if peer[1] is None:
            raise UserError(f"a {kind} in the graph has no {'dst' if kind == 'send' else 'src'} rank; Chakra needs its peer")
        return P2P[kind], [(peer[0], "int32_val", peer[1]), ("comm_tag", "int32_val", data["tag"]),
                           ("comm_size", "int64_val", max(data["bytes"], 1)), ("pg_name", "string_val", pg_name)]
    return collective_attrs(kind, data["bytes"], len(data["group"]), pg_name)


def chakra_nodes(graph: nx.DiGraph, groups: Mapping[tuple, int], p2p_all_to_all: bool = False) -> list[NodeSpec]:
    """The Chakra nodes of one rank's graph, ids 0.. in traced order; `groups` maps each process group
    (sorted ranks) to its comm-group id (chakra/groups.py). `p2p_all_to_all`: write each all-to-all that
    knows its bytes per peer as sends and recvs (_p2p_parts; a skewed MoE load's, whose members move unequal
    bytes)."""
    try:  # in node order, the tracer's, when every producer comes before its readers (not checked first:
        # the check alone was a pass over every node's inputs; a producer not yet seen fails the lookup)
        return _chakra_nodes(graph, graph, groups, p2p_all_to_all)
    except KeyError:
        if _in_traced_order(graph):  # a lookup that failed for another reason
            raise
    return _chakra_nodes(graph, list(nx.topological_sort(graph)), groups, p2p_all_to_all)


def _in_traced_order(graph: nx.DiGraph) -> bool:
    """Does every op come after the ops that produce its inputs, in node order (the tracer's order)?"""
    seen, pred = set(), graph.preds
    for n, d in graph.node_attrs.items():
        if d["kind"] != "tensor":
            if any(p not in seen for t in pred[n] for p in pred[t]):
                return False
            seen.add(n)
    return True


NO_TENSORS = ("[]", "[]", "[]")
IS_CPU_OP = ("is_cpu_op", "bool_val", False)


def _chakra_nodes(graph, order, groups, p2p_all_to_all=False) -> list[NodeSpec]:
    nodes, pred, succ, out = graph.node_attrs, graph.preds, graph.succs, []
    deps_of = {}  # graph node -> the Chakra ids its consumers depend on (itself, or what a folded node depended on)
    last_comm = {}  # channel (a group's ranks, or a p2p pair) -> its previous communication node's Chakra id
    tensor_text = {}  # tensor -> (id, shape, dtype, [shape], [dtype]) as JSON text, built once
    layout_text = {}  # (shape, dtype) -> their JSON text: a stage's 10^4 tensors have a few dozen
    # (FLOPs, bytes, duration) -> an op's attributes, one list for every op that has them: a stage's 10^4 ops
    # have ~100 (StageTemplate serializes each list once)
    op_attrs = {}

    def text(t):
        d = nodes[t]
        key = tuple(d["shape"]), d["dtype"]
        if key not in layout_text:
            shape, dtype = "[" + ",".join(map(str, d["shape"])) + "]", '"' + d["dtype"] + '"'
            layout_text[key] = shape, dtype, f"[{shape}]", f"[{dtype}]"  # and as lists of one
        tensor_text[t] = found = (str(t), *layout_text[key])
        return found

    def io_text(tensors):
        if len(tensors) == 1:  # most nodes' inputs and outputs: no lists to join
            i, _, _, shapes, types = tensor_text.get(tensors[0]) or text(tensors[0])
            return f"[{i}]", shapes, types
        if not tensors:
            return NO_TENSORS
        ids, shapes, types, _, _ = zip(*[tensor_text.get(t) or text(t) for t in tensors])
        return f"[{','.join(ids)}]", f"[{','.join(shapes)}]", f"[{','.join(types)}]"

    phase = None  # written where it changes (the host's syncs the cost model needs: trace/cost.add_host_waits)
    for n in order:
        data = nodes[n]
        kind = data["kind"]
        if kind == "tensor":
            continue
        sources = pred[n]
        producers = pred[next(iter(sources))] if len(sources) == 1 else ()
        if len(producers) == 1:  # one producer (most nodes): its ids as they are (sorted, distinct)
            deps = deps_of[next(iter(producers))]
        else:
            deps = sorted({i for t in sources for p in pred[t] for i in deps_of[p]})
        if kind == "op" and _folded(data):
            deps_of[n] = deps
            continue
        inputs = _ordered(sources)
        new_phase = None
        if data.get("phase") != phase:
            phase = data.get("phase")
            new_phase = phase or ""
        if kind == "op":
            duration = data.get("duration_us") or 0
            key = data["flops"], data["bytes_read"] + data["bytes_written"], duration
            if new_phase is not None:  # the one op where the phase changes says so: its own list
                attrs = _node_attrs(_comp_attrs(*key[:2]), new_phase, duration)
            else:
                attrs = op_attrs.get(key) or op_attrs.setdefault(key, _node_attrs(_comp_attrs(*key[:2]), None, duration))
            nid = len(out)
            out.append(NodeSpec(nid, _node_name(data), et.COMP_NODE, deps, [], round(duration), io_text(inputs),
                                io_text(_ordered(succ[n])), attrs))
            deps_of[n] = [nid]
            continue
        pg_name = str(groups[tuple(sorted(data["group"]))])
        parts = (_p2p_parts(data, graph.graph.get("rank", 0), pg_name)
                 if p2p_all_to_all and data["collective"] == "all_to_all" and "send_bytes" in data else
                 [(*_comm_attrs(data, pg_name), _channel(data), _node_name(data), data, True)])
        ids, outputs = [], _ordered(succ[n])
        for kind, attrs, channel, name, timed, whole in parts:  # whole: the graph node's, not one of its sends/recvs
            nid = len(out)
            ctrl, last_comm[channel] = ([last_comm[channel]] if channel in last_comm else []), nid
            duration = timed.get("duration_us") or 0
            out.append(NodeSpec(nid, name, kind, deps, ctrl, round(duration),
                                io_text(inputs if whole or kind == et.COMM_SEND_NODE else []),
                                io_text(outputs if whole or kind == et.COMM_RECV_NODE else []),
                                _node_attrs(attrs, new_phase, duration)))
            new_phase = None  # said by the first part
            if whole or kind == et.COMM_RECV_NODE:  # what consumes an all-to-all's rows waits for all its recvs
                ids.append(nid)
        deps_of[n] = ids or deps
    return out


def _ordered(adj: dict) -> list:
    """A node's inputs or outputs (tensors, by the edges' `adj`) in argument order."""
    return sorted(adj, key=lambda t: adj[t].get("arg", 0)) if len(adj) > 1 else [*adj]


def _comp_attrs(flops: int, nbytes: int) -> list:
    # ASTRA-sim's roofline runs num_ops / min(bw * num_ops / tensor_size, peak): 0 FLOPs would be 0/0,
    # 1 FLOP gives a memory-bound op its tensor_size / bw
    return [("num_ops", "int64_val", max(flops, 1)), ("tensor_size", "uint64_val", nbytes)]


def _node_attrs(attrs: list, phase: str | None, duration_us: float) -> list:
    """`attrs` and what follows them on every node: is_cpu_op, the `phase` where it changes (None where not)
    and, when timed, the duration in ns (duration_micros is whole µs; syntorch predict replays this)."""
    attrs = [*attrs, IS_CPU_OP]
    if phase is not None:
        attrs.append(("phase", "string_val", phase))
    if duration_us:
        attrs.append(("duration_ns", "uint64_val", round(duration_us * 1e3)))
    return attrs


A2A_TAG_BASE = 1 << 24  # above the pipeline's tags (pipeline.tag: 2(mV + c)), so an all-to-all's never meets one


def _p2p_parts(data: dict, rank: int, pg_name: str) -> list[tuple]:
    """A variable all-to-all as NCCL runs it, grouped sends and recvs of each pair's own bytes (ASTRA-sim's
    ALL_TO_ALL sends comm_size / members to every peer and matches messages by size, so members of unequal
    sizes never meet): hop by hop, a send to the member `hop` after this rank and a recv from the one `hop`
    before it, as a pairwise exchange (all sends first left ASTRA-sim stuck at a later all-reduce of an
    8-rank EP4 x PP2 run; hop by hop it finishes). The tag numbers the
    all-to-all in its group (`order`, alike on every member) and the hop from sender to receiver along the
    group, so a send meets exactly its recv."""
    group, sends, recvs = data["group"], data["send_bytes"], data["recv_bytes"]
    size, me, module = len(group), group.index(rank), data.get("module") or "root"
    # the all-to-all's time (a costed run) shared by its sends by their bytes: syntorch predict runs a rank's
    # sends one after another on its p2p stream and ends each recv when its send's bytes have arrived
    sent = sum(sends) - sends[me]
    per_byte = (data.get("duration_us") or 0) / sent if sent else 0
    parts = []
    for hop in range(1, size):
        for kind, sizes, step in (("send", sends, 1), ("recv", recvs, -1)):
            peer = (me + step * hop) % size
            src, dst = (rank, group[peer]) if kind == "send" else (group[peer], rank)
            p2p = {"collective": kind, "src": src, "dst": dst, "bytes": sizes[peer],
                   "tag": A2A_TAG_BASE + data["order"] * size + hop}
            timed = {"duration_us": sizes[peer] * per_byte} if kind == "send" else {}
            parts.append((*_comm_attrs(p2p, pg_name), _channel(p2p), f"{module}:all_to_all_{kind}", timed, False))
    return parts


def _channel(data: dict) -> tuple:
    """What a communication node is ordered within: the ranks it involves, a group's or a p2p pair's. A pair
    whose two ranks also form a group (the first and last stage that share a tied embedding) is one channel
    with it: ASTRA-sim matches both under the pair's pg_name, in issue order, and hangs if one rank runs the
    embedding's all-reduce before a recv that its peer's send precedes."""
    if data["collective"] in P2P:
        return tuple(sorted((data["src"], data["dst"])))
    return tuple(sorted(data["group"]))


def _node_name(data: dict) -> str:
    """`module:what`: the aten op, or the collective's kind (its c10d op name says no more than comm_type).
    A level's group (it has `num_ops`) is named by its module alone: writing it twice was ~6% of a
    module-level file."""
    module = data.get("module") or "root"
    if "num_ops" in data:
        return module
    return f"{module}:{data['collective'] if data['kind'] == 'collective' else data['name']}"


def _attr(name: str, **value) -> et.AttributeProto:
    return et.AttributeProto(name=name, **value)


def global_metadata(graph: nx.DiGraph, model: str, level: str, notes: list[str], durations: bool) -> et.GlobalMetadata:
    g = graph.graph
    return et.GlobalMetadata(version=SCHEMA_VERSION, attr=[
        _attr("producer", string_val=f"syntorch {g.get('syntorch_version', '')}".strip()),
        _attr("model", string_val=model), _attr("level", string_val=level),
        _attr("rank", int64_val=g.get("rank", 0)), _attr("world_size", int64_val=g.get("world_size", 1)),
        *[_attr(k, int64_val=g.get(k, 1)) for k in ("tp", "pp", "dp")],
        *([_attr("cp", int64_val=g["cp"])] if g.get("cp", 1) > 1 else []),  # files of cp = 1 runs as before
        _attr("durations", string_val="from hw_config" if durations else "none (no --hw_config): 0 us"),
        _attr("notes", string_list=et.StringList(values=notes)),
    ])
