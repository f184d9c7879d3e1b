"""What mlc-chakra's converter leaves wrong for ASTRA-sim in a CPU (gloo) capture, fixed on its nodes.

The official converter (mlc-chakra 1.0.0) makes communication nodes only from GPU kernels named
ncclKernel/ncclDevKernel. A gloo collective is a CPU op (`gloo:all_reduce`), so it comes out as a plain
COMP_NODE chained serially behind the main thread's ops: the simulator would neither model the network
nor let backward overlap with the gradient all-reduce. Here, on the converted nodes:

1. METADATA nodes (`## process_group:init ##`) are dropped (ASTRA-sim aborts on them); whoever depended
   on one depends on what it depended on.
2. gloo collectives become COMM_COLL_NODEs written as syntorch writes a traced collective (chakra/nodes.py's
   one table: comm_type, comm_size, pg_name; broadcast, reduce and barrier as collectives ASTRA-sim
   simulates), from the bytes of the op's input tensors; is_cpu_op false. The type is the collective the
   program called (the c10d op: gloo runs a reduce-scatter as an all-reduce), the group the one torch's
   flight recorder logged (flight_recorder.py). Sends and recvs become COMM_SEND/RECV_NODEs with their global
   peer (peers.py), tag and bytes. Every other field the official tools wrote is kept.
3. Dependencies: a collective depends on the op that launched it and on the group's previous
   collective (one queue per process group, as gloo and NCCL run them; a send or recv on its pair's). It
   leaves the main thread's serial chain; the first later op that touches its tensors' storage (DDP's copy
   of the bucket back into the gradients) depends on it. So backward compute after a bucket's launch overlaps its
   all-reduce, as it did in the run.
4. Dependencies on nodes the converter dropped (it removes "dangling" nodes that others still name in
   ctrl_deps) are removed: ASTRA-sim stops on a dependency it cannot find.

Before conversion, `drop_forward_inter_thread_deps` fixes the linked JSON: the linker makes an op depend
on the last op another thread finished before it started ("inter_thread_dep"). A gloo op sits in the
host trace where it was launched but runs later on gloo's thread, so it can get a dependency on a
main-thread op that comes after it in the converter's serial chain: a cycle, and the converter stops
("Cyclic dependency detected"). Those dependencies are timing, not data, and are dropped.
"""
import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field

import networkx as nx
from chakra.schema.protobuf import et_def_pb2 as et

from syntorch.capture.peers import point_to_point
from syntorch.capture.traces import tensor_refs
from syntorch.chakra.nodes import COLLECTIVE_TYPES, P2P, collective_attrs

# c10d ops (what the program called) -> the graph's collective kinds
C10D_COLLECTIVES = {"c10d::allreduce_": "all_reduce", "c10d::_allgather_base_": "all_gather",
                    "c10d::allgather_": "all_gather", "c10d::_reduce_scatter_base_": "reduce_scatter",
                    "c10d::reduce_scatter_": "reduce_scatter", "c10d::alltoall_base_": "all_to_all",
                    "c10d::alltoall_": "all_to_all", "c10d::broadcast_": "broadcast", "c10d::barrier": "barrier",
                    "c10d::reduce_": "reduce", "c10d::gather_": "gather", "c10d::scatter_": "scatter"}
THREAD_ROOTS = ("[pytorch|profiler|execution_graph|thread]", "[pytorch|profiler|execution_trace|thread]")


def drop_forward_inter_thread_deps(host_nodes: list[dict]) -> int:
    """Removes every inter_thread_dep naming a node the converter's chain visits later (the chain is a
    pre-order walk of the ctrl_deps tree from each thread root, children by id, as mlc-chakra walks it).
    Returns how many were removed."""
    by_id = {n["id"]: n for n in host_nodes}
    children = defaultdict(list)
    for n in host_nodes:
        if n["ctrl_deps"] in by_id and n["ctrl_deps"] != n["id"]:
            children[n["ctrl_deps"]].append(n["id"])
    order = {}
    for root in (n["id"] for n in host_nodes if n["name"] in THREAD_ROOTS):
        stack = [root]
        while stack:
            node_id = stack.pop()
            if node_id not in order:
                order[node_id] = len(order)
                stack.extend(sorted(children[node_id], reverse=True))
    dropped = 0
    for n in host_nodes:
        dep = n.get("inter_thread_dep")
        if dep is not None and order.get(dep, math.inf) >= order.get(n["id"], -1):
            n["inter_thread_dep"] = None
            dropped += 1
    return dropped


@dataclass
class Communication:
    """What a capture's trace does not say about its communication, found elsewhere (to_chakra.py)."""
    rank: int
    groups: dict[str, list[int]]  # process group name -> global ranks (the profiler's pg_config)
    # (profiling name, group name) of each collective in issue order (flight_recorder.py); None: unknown
    collectives: list[tuple[str, str]] | None = None
    peers: dict[int, tuple[int, str]] = field(default_factory=dict)  # send/recv op id -> (global peer, group)

    def default_group(self) -> str:
        """Where collectives go when the recorder did not say: the only group, or the default one ("0")."""
        return next(iter(self.groups)) if len(self.groups) == 1 else "0"


def fix_nodes(nodes: list, host_nodes: dict, comm: Communication) -> tuple[list, dict]:
    """The converter's nodes made ASTRA-sim-ready, and a summary (collectives, bytes, notes).
    `host_nodes` are the linked JSON nodes by id (the converter keeps their ids)."""
    by_id = {n.id: n for n in nodes}
    _bypass(by_id, {i for i, n in by_id.items() if n.type == et.METADATA_NODE}, drop=True)
    channels, notes = _make_communication(by_id, host_nodes, comm)
    _restore_dependencies(by_id, channels, host_nodes)
    for node in by_id.values():  # the converter dropped some nodes that others still name (rule 4 above)
        for deps in (node.data_deps, node.ctrl_deps):
            kept = [d for d in deps if d in by_id]
            del deps[:]
            deps.extend(kept)
    _check_acyclic(by_id)
    collectives = [c for c in channels if by_id[c].type == et.COMM_COLL_NODE]
    sizes = [_attr(by_id[c], "comm_size").int64_val for c in collectives]
    return [by_id[i] for i in sorted(by_id)], {"collectives": len(collectives), "comm_bytes": sum(sizes),
                                               "notes": sorted(notes)}


def _attr(node, name):
    return next((a for a in node.attr if a.name == name), None)


def _bypass(by_id: dict, skipped: set, drop: bool) -> None:
    """Nodes that depended on a skipped node depend on its dependencies instead (transitively)."""
    def expand(dep, kind, seen=()):
        if dep not in skipped or dep in seen:
            return [dep]
        return [d for up in getattr(by_id[dep], kind) for d in expand(up, kind, (*seen, dep))]

    originals = {i: (list(by_id[i].data_deps), list(by_id[i].ctrl_deps)) for i in skipped}
    for node in by_id.values():
        for kind in ("data_deps", "ctrl_deps"):
            deps = getattr(node, kind)
            new = list(dict.fromkeys(d for dep in deps for d in expand(dep, kind) if d != node.id))
            del deps[:]
            deps.extend(new)
    for i in skipped:
        if drop:
            del by_id[i]
        else:  # the skipped node itself keeps what it depended on
            by_id[i].data_deps[:], by_id[i].ctrl_deps[:] = originals[i]


def _make_communication(by_id: dict, host_nodes: dict, comm: Communication) -> tuple[dict[int, tuple], set[str]]:
    """gloo COMP_NODEs -> COMM_COLL/SEND/RECV nodes; returns {node id: its channel (ranks)} in issue order, and
    the notes."""
    gloo = [i for i in sorted(by_id) if by_id[i].type == et.COMP_NODE and by_id[i].name.startswith("gloo:")]
    p2p = [i for i in gloo if by_id[i].name.removeprefix("gloo:") in P2P]
    collectives = [i for i in gloo if i not in set(p2p)]
    channels, notes, called = {}, set(), called_collectives(host_nodes)
    recorded = comm.collectives
    if recorded is not None and [name for name, _ in recorded] != [by_id[i].name for i in collectives]:
        notes.add(f"the flight recorder's {len(recorded)} collectives are not the trace's {len(collectives)}; "
                  f"gloo collectives assigned to group {comm.default_group()}")
        recorded = None
    elif recorded is None and len(comm.groups) > 1:
        notes.add(f"trace has {len(comm.groups)} process groups and no flight recorder log; "
                  "gloo collectives assigned to the default group 0")
    for k, node_id in enumerate(collectives):
        pg_name = recorded[k][1] if recorded else comm.default_group()
        members = comm.groups.get(pg_name) or [comm.rank]
        kind = called.get(node_id) or by_id[node_id].name.removeprefix("gloo:")
        if _make_collective(by_id[node_id], kind, host_nodes.get(node_id, {}), pg_name, len(members), notes):
            channels[node_id] = tuple(sorted(members))
    for node_id in p2p:
        launcher = host_nodes.get(node_id, {}).get("ctrl_deps")  # the c10d op, which holds the peer and tag
        op = point_to_point(host_nodes[launcher]) if launcher in host_nodes else None
        peer = comm.peers.get(launcher)
        if op is None or peer is None:
            notes.add(f"{by_id[node_id].name} whose peer was not found left as a compute node")
            continue
        _rewrite(by_id[node_id], P2P[op.kind], [("comm_dst" if op.kind == "send" else "comm_src", "int32_val", peer[0]),
                                                ("comm_tag", "int32_val", op.tag),
                                                ("comm_size", "int64_val", max(op.nbytes, 1)),
                                                ("pg_name", "string_val", peer[1])])
        channels[node_id] = tuple(sorted({comm.rank, peer[0]}))
    return dict(sorted(channels.items())), notes


def called_collectives(host_nodes: dict) -> dict[int, str]:
    """gloo op id -> the collective the program called for it: its c10d op's (the op's parent, or the c10d op
    launched last before it under the same parent). gloo runs some as others: a reduce-scatter is an all_reduce
    of the whole buffer there, as its profiler name says, but NCCL runs the reduce-scatter."""
    called, last_c10d = {}, {}  # parent id -> the latest c10d op under it
    for node_id in sorted(host_nodes):
        node = host_nodes[node_id]
        name, parent = node["name"], node.get("ctrl_deps")
        if name.startswith("c10d::"):
            last_c10d[parent] = name
        elif name.startswith("gloo:"):
            launcher = host_nodes.get(parent, {}).get("name", "")
            kind = C10D_COLLECTIVES.get(launcher if launcher.startswith("c10d::") else last_c10d.get(parent, ""))
            if kind:
                called[node_id] = kind
    return called


def _make_collective(node, kind: str, host_node: dict, pg_name: str, group_size: int, notes: set) -> bool:
    if kind not in COLLECTIVE_TYPES:
        notes.add(f"{node.name} left as a compute node (no ASTRA-sim collective for it)")
        return False
    size = sum(b for _, b in tensor_refs(host_node.get("inputs", {})))
    if size <= 0 and kind != "barrier":
        notes.add(f"{node.name} node {node.id} moves no bytes in the host trace; left as a compute node")
        return False
    # a gather's input is this rank's part; the graph's convention is the larger buffer
    nbytes = size * group_size if kind in ("all_gather", "gather") else size
    node_type, attrs = collective_attrs(kind, nbytes, group_size, pg_name)
    notes.update(note for note in [COLLECTIVE_TYPES[kind][2]] if note)
    _rewrite(node, node_type, attrs)
    return True


def _rewrite(node, node_type: int, attrs: list) -> None:
    """`node` made a communication node with `attrs` (name, value field, value); its other attributes kept."""
    names = {name for name, _, _ in attrs} | {"is_cpu_op"}
    kept = [a for a in node.attr if a.name not in names]
    node.type = node_type
    del node.attr[:]
    node.attr.extend(kept + [et.AttributeProto(name="is_cpu_op", bool_val=False)] +
                     [et.AttributeProto(name=name, **{field: value}) for name, field, value in attrs])


def _restore_dependencies(by_id: dict, channels: dict[int, tuple], host_nodes: dict) -> None:
    _bypass(by_id, set(channels), drop=False)
    touching = _storage_index(by_id, host_nodes, skip=set(channels))
    previous = {}
    for c, channel in channels.items():
        node = by_id[c]
        launcher = [p for p in node.ctrl_deps if p in by_id] or list(node.data_deps)
        node.data_deps[:] = list(dict.fromkeys(launcher + ([previous[channel]] if channel in previous else [])))
        previous[channel] = c
        consumer = _first_toucher(touching, host_nodes.get(c, {}).get("inputs", {}), after=c)
        if consumer is not None and c not in by_id[consumer].data_deps:
            by_id[consumer].data_deps.append(c)


def _storage_index(by_id: dict, host_nodes: dict, skip: set) -> dict[int, list[int]]:
    """storage id -> sorted ids of the nodes that read or write it."""
    index = defaultdict(list)
    for node_id in sorted(by_id):
        host = host_nodes.get(node_id)
        if host is None or node_id in skip:
            continue
        for storage in {s for io in ("inputs", "outputs") for s, _ in tensor_refs(host.get(io, {}))}:
            index[storage].append(node_id)
    return index


def _first_toucher(touching: dict, inputs: dict, after: int):
    found = []
    for storage, _ in tensor_refs(inputs):
        ids = touching.get(storage, [])
        i = bisect.bisect_right(ids, after)
        if i < len(ids):
            found.append(ids[i])
    return min(found, default=None)


def _check_acyclic(by_id: dict) -> None:
    graph = nx.DiGraph()
    graph.add_nodes_from(by_id)
    graph.add_edges_from((d, n.id) for n in by_id.values() for d in (*n.data_deps, *n.ctrl_deps))
    if not nx.is_directed_acyclic_graph(graph):
        cycle = " -> ".join(str(u) for u, _ in nx.find_cycle(graph))
        raise RuntimeError(f"repaired trace has a dependency cycle ({cycle}); this is a syntorch bug, please report it")
