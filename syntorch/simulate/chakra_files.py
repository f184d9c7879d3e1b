"""Chakra files already written (ours, or converted captures) as simulator programs.

Each file becomes a TraceGraph (an op or collective per Chakra node, its data deps as edges through one
output tensor) and runs in the one simulator, a stream per communicator. A ctrl dep from one communication
node to another adds no edge: the streams already issue a communicator's work in order, and NCCL orders
nothing across communicators (ctrl deps that reach compute nodes stay edges).

Durations: the files' own (`duration_ns` where our writer added it, else the whole µs of `duration_micros`),
which syntorch trace writes from the cost model (trace/cost.py, op by op, summed per module) and records,
with the hardware, profile and attention kernel, in RANK_KINDS. So `predict DIR`
replays them, and predicts what `trace --hw_config` did, when given no --hw_config or that same one; given
another (or on files we did not write), fill_durations costs each node from what the file holds (a
module-level node: a roofline of its summed FLOPs and bytes, not its kernels' times).

Our writer (workload.py) writes every rank of a stage from one template in which only comm-group ids and
p2p peers differ (chakra/writer.py's StageTemplate), and leaves RANK_KINDS beside the files: the mesh and
each file's size and modification time, and the EP indices of each rank kind (parallel/moe_load.py). When
every file is still as written there, each stage's representative (one per rank kind) is read and simulated
for all its ranks (graphs.MeshFrame); otherwise (a file changed, or traces we did not write) every rank is
read and simulated on its own.
"""
import json
import re
from pathlib import Path

from chakra.schema.protobuf import et_def_pb2 as et

from syntorch.chakra.reader import find_traces, read_trace
from syntorch.chakra.validator import load_comm_groups
from syntorch.errors import UserError
from syntorch.hardware import HardwareConfig, config_from_dict
from syntorch.parallel.mesh import Mesh
from syntorch.parallel.moe_load import RankKinds
from syntorch.simulate.engine import simulate
from syntorch.simulate.graphs import MeshFrame, RankFrame, graph_program
from syntorch.simulate.prediction import Prediction, run_summary
from syntorch.trace.cost import fill_durations
from syntorch.trace.graph import TraceGraph, no_gc
from syntorch.userfiles import read_json

RANK_KINDS = "syntorch_ranks.json"
COLLECTIVE_OF = {et.ALL_REDUCE: "all_reduce", et.REDUCE: "all_reduce", et.ALL_GATHER: "all_gather",
                 et.GATHER: "all_gather", et.SCATTER: "all_gather", et.BROADCAST: "broadcast",
                 et.ALL_TO_ALL: "all_to_all", et.REDUCE_SCATTER: "reduce_scatter", et.BARRIER: "barrier"}
PER_RANK_PART = {"all_gather"}  # comm_size is each rank's part (chakra/nodes.py), the graph counts the output
DTYPES = {"BFloat16": "bfloat16", "Half": "float16", "float": "float32", "double": "float64"}


def rank_kinds_json(model: str, mesh: Mesh, folder: Path, hw: HardwareConfig | None = None,
                    profile: str | None = None, attention: str = "flash", ep_kinds: list | None = None) -> str:
    """The mesh, the EP indices of each rank kind of a stage (moe_load.RankKinds), each rank's file as written
    (size and modification time: the quick check rsync and make use; a file rewritten since, even to the
    same size, shows a new time) and what its durations are from."""
    stats = [(folder / f"{model}.{rank}.et").stat() for rank in range(mesh.world_size)]
    return json.dumps({"format": "syntorch rank kinds 1", "prefix": model,
                       "mesh": mesh.to_json(), "ep_kinds": ep_kinds or [list(range(mesh.ep))],
                       "files": [[st.st_size, st.st_mtime_ns] for st in stats],
                       "durations": {"hw_config": hw.to_dict(), "profile": profile, "attention": attention}
                       if hw else None})


def predict_traces(path, hw=None, profile: str | None = None, attention: str | None = None) -> Prediction:
    """A simulated step of the traces at `path` (DIR or PREFIX); durations from `hw`'s model, else the files'.
    `profile`, `attention`: None keeps what the files' durations were written with (else eager, flash)."""
    with no_gc():  # many small dicts and lists, none cyclic
        return _predict_traces(path, hw, profile, attention)


def _predict_traces(path, hw, profile, attention) -> Prediction:
    files = find_traces(path)
    folder = files[0][1].parent
    groups = {k: sorted(v) for k, v in load_comm_groups(folder / "comm_groups.json", explicit=False).items()}
    world = len(files)
    rank_kinds, why, written = _symmetric_mesh(folder, files)
    replay = _replays(written, hw, profile, attention)
    if replay:
        hw, profile, attention = config_from_dict(written["hw_config"]), written["profile"], _attention(written)
    if rank_kinds is not None:
        paths, mesh = dict(files), rank_kinds.mesh
        kinds = [(f"stage {s}" + (f" EP kind {k}" if rank_kinds.count > 1 else ""), rank_kinds.representative(s, k),
                  paths[rank_kinds.representative(s, k)], rank_kinds.ranks(k))
                 for s in range(mesh.pp) for k in range(rank_kinds.count)]
        frame, note = MeshFrame(mesh, rank_kinds), f"one program per pipeline stage and rank kind, from {RANK_KINDS}"
    else:
        kinds = [(f"rank {rank}", rank, f, 1) for rank, f in files]
        frame, note = RankFrame(), f"every rank simulated on its own: {why}"
    programs, flops, dtypes = [], 0, {}
    for name, rank, f, ranks in kinds:
        graph = chakra_graph(f, rank, world, groups)
        if hw is not None and not replay:
            fill_durations(graph, hw, profile or "eager", attention or "flash")
        programs.append(graph_program(graph, name, frame, ranks)[0])
        for d in graph.node_attrs.values():
            if d["kind"] == "op":
                flops += ranks * d["flops"]
                dtypes[d["dtype"]] = dtypes.get(d["dtype"], 0) + d["flops"]
    run = simulate(programs)
    # every COMP node counts: a Chakra file does not say which ops are recomputations or the optimizer's
    peak = hw.peak_flops(max(dtypes, key=dtypes.get)) if hw is not None and dtypes else 0.0
    summary = run_summary(run, flops, flops, peak)
    summary.update(hw_config=hw.name if hw else None, profile=profile, attention=attention, traces=str(path),
                   ranks=world, notes=[note, _durations_note(hw, profile, attention, replay)])
    return Prediction(run, summary)


def _replays(written: dict | None, hw, profile, attention) -> bool:
    """Do the files' durations answer for `hw`, `profile` and `attention` (written by the same cost model for
    them)?"""
    if not written:
        return False
    return hw is None or (hw.to_dict() == written["hw_config"] and profile in (None, written["profile"])
                          and attention in (None, _attention(written)))


def _attention(written: dict) -> str:
    """Files written before --attention existed timed attention as flash kernels only under the eager profile."""
    return written.get("attention", "flash" if written["profile"] == "eager" else "unfused")


def _durations_note(hw, profile, attention, replay: bool) -> str:
    if replay:
        return (f"durations as syntorch trace wrote them (--hw_config {hw.name} --profile {profile} "
                f"--attention {attention}), replayed")
    if hw is None:
        return "durations from the files' duration_micros"
    return f"durations from --hw_config {hw.name}'s model of each node as the files hold it"


def _symmetric_mesh(folder, files) -> tuple[RankKinds | None, str, dict | None]:
    """The rank kinds of RANK_KINDS and what its durations are from (None: no hardware) when every file is
    still as our writer left it (by size and time), else (None, why not, None)."""
    path = folder / RANK_KINDS
    if not path.is_file():
        return None, f"no {RANK_KINDS} (traces not written by syntorch trace)", None
    data = read_json(path, "rank kinds file")
    try:
        mesh = Mesh(**data["mesh"])
        kinds = RankKinds(mesh, data.get("ep_kinds"))
        written = [(int(size), int(mtime)) for size, mtime in data["files"]]
        prefix = str(data["prefix"])
        durations = data.get("durations")
    except (KeyError, TypeError, ValueError, IndexError, UserError):
        raise UserError(f"{path}: not a {RANK_KINDS} written by syntorch trace; delete it to simulate every rank") from None
    if [r for r, _ in files] != list(range(mesh.world_size)) or len(written) != mesh.world_size:
        return None, f"{RANK_KINDS} is for {mesh.world_size} ranks, the folder has {len(files)}", None
    for rank, f in files:
        st = f.stat()
        if not f.name.startswith(prefix + ".") or (st.st_size, st.st_mtime_ns) != written[rank]:
            return None, f"{f.name} changed since syntorch trace wrote it (a copy keeps the fast path with cp -p)", None
    return kinds, "", durations


def chakra_graph(path, rank: int, world: int, groups: dict) -> TraceGraph:
    """One .et file as a TraceGraph in dependency order; durations from `duration_micros`."""
    header, nodes = read_trace(path)
    graph = TraceGraph(rank=rank, world_size=world, model=path.name.split(".")[0])
    index = {n.id: n for n in nodes}
    specs, edges, place, orders, phase = [], [], {}, {}, ""
    for node in _dependency_order(nodes, index, path):
        op, out = 2 * len(place), 2 * len(place) + 1
        place[node.id] = out
        attrs = _node_attrs(node, rank, world, groups, orders, path)
        phase = attrs["phase"] = attrs["phase"] or phase  # our writer names a phase where it changes
        specs += [attrs,
                  {"kind": "tensor", "name": f"t{out}", "shape": (_shapes(node.outputs) or [[]])[0], "dtype": _dtype(node), "bytes": 0,
                   "is_param": False, "device": "meta", "version": 0}]
        edges += [(place[d], op, {"arg": i}) for i, d in enumerate(dict.fromkeys([*node.data_deps, *_ctrl_deps(node, index)]))]
        edges.append((op, out, {"arg": 0}))
    graph.append(specs, edges)
    return graph


COMM_NODES = (et.COMM_COLL_NODE, et.COMM_SEND_NODE, et.COMM_RECV_NODE)


def _ctrl_deps(node, index) -> list[int]:
    """The ctrl deps that order work: one communication node after another is already ordered by the
    streams (one per communicator, issue order), and NCCL orders nothing across communicators."""
    if node.type not in COMM_NODES:
        return list(node.ctrl_deps)
    return [d for d in node.ctrl_deps if index[d].type not in COMM_NODES]


def _dependency_order(nodes, index, path):
    """The nodes with each after its deps (ours already are: ids in traced order)."""
    done, order = set(), []
    for root in nodes:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node.id in done:
                continue
            if expanded:
                done.add(node.id)
                order.append(node)
                continue
            stack.append((node, True))
            for d in [*node.data_deps, *node.ctrl_deps]:
                if d not in index:
                    raise UserError(f"{path}: node {node.id} depends on node {d}, which the file lacks")
                if d not in done:
                    stack.append((index[d], False))
    return order


def _node_attrs(node, rank, world, groups, orders, path) -> dict:
    attrs = {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr if a.WhichOneof("value")}
    module, _, what = node.name.rpartition(":")
    # duration_ns: what our writer adds beside the whole µs of duration_micros (chakra/nodes.py)
    us = attrs["duration_ns"] / 1e3 if "duration_ns" in attrs else float(node.duration_micros)
    base = {"name": what or node.name, "module": module or node.name, "phase": attrs.get("phase", ""),
            "duration_us": us}
    if node.type == et.COMP_NODE:
        return {**base, "kind": "op", "flops": int(attrs.get("num_ops", 0)), "dtype": _dtype(node), "bytes_read": int(attrs.get("tensor_size", 0)),
                "bytes_written": 0, "is_view": False, "input_shapes": _shapes(node.inputs)}
    size = int(attrs.get("comm_size", 0))
    if node.type in (et.COMM_SEND_NODE, et.COMM_RECV_NODE):
        send = node.type == et.COMM_SEND_NODE
        peer = int(attrs.get("comm_dst" if send else "comm_src", 0))
        return {**base, "kind": "collective", "collective": "send" if send else "recv", "reduce_op": None,
                "group": sorted({rank, peer}), "bytes": size, "src": None if send else peer,
                "dst": peer if send else None, "tag": int(attrs.get("comm_tag", 0)), "order": 0}
    if node.type != et.COMM_COLL_NODE:
        return {**base, "kind": "op", "flops": 0, "bytes_read": 0, "bytes_written": 0, "is_view": True}
    pg = str(attrs.get("pg_name", ""))
    if pg not in ("", "0") and pg not in groups:
        raise UserError(f"{path}: node {node.id} names comm group {pg!r}, which comm_groups.json lacks")
    group = groups.get(pg, list(range(world)))
    kind = COLLECTIVE_OF.get(int(attrs.get("comm_type", 0)), "all_reduce")
    order = orders[tuple(group)] = orders.get(tuple(group), -1) + 1
    return {**base, "kind": "collective", "collective": kind, "reduce_op": None, "group": group,
            "bytes": size * len(group) if kind in PER_RANK_PART else size, "src": None, "dst": None, "tag": 0,
            "order": order}


def _shapes(io) -> list[list[int]]:
    """An IOInfo's shapes, from its JSON text (`[[8,768],[768,2304]]`): what a GEMM's tiles and an attention
    kernel are costed from (trace/cost.py); none when the file does not say them as such."""
    try:
        shapes = json.loads(io.shapes or "[]")
    except ValueError:
        return []
    ok = isinstance(shapes, list) and all(isinstance(s, list) and all(type(d) is int and d >= 0 for d in s)
                                          for s in shapes)
    return shapes if ok else []


def _dtype(node) -> str:
    found = re.search(r"(b?float\d+|BFloat16|Half|float|double)", node.outputs.types or node.inputs.types)
    return DTYPES.get(found.group(1), found.group(1)) if found else "float32"
