"""Reading captured traces: the host execution trace (ExecutionTraceObserver JSON) and the device trace
(Kineto JSON). Traces come from other machines, so everything is checked and a bad file is one UserError.

Host traces need repair before the official linker reads them: a profiler that runs more than one
cycle with the same output path leaves several JSON documents back to back in one file, and node ids
can appear twice (the seed project's fix_host_traces.py removed these duplicates by hand).
"""
import json
from pathlib import Path

from syntorch.errors import UserError


def _read_text(path: Path, what: str) -> str:
    if not path.is_file():
        raise UserError(f"{what} not found: {path}")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {what} {path}: {e}") from None


def _json_documents(text: str) -> list:
    """Every JSON value in `text`, in order (one for a healthy file)."""
    decoder, docs, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
            continue
        value, pos = decoder.raw_decode(text, pos)
        docs.append(value)
    return docs


def repair_host_trace(trace_text: str, source: str = "host trace") -> tuple[dict, list[str]]:
    """(host trace, repairs made). Keeps the largest of several concatenated documents and the first of
    each duplicated node id. Raises UserError when the text is not a host execution trace at all."""
    try:
        docs = _json_documents(trace_text)
    except json.JSONDecodeError as e:
        raise UserError(f"{source} is not valid JSON ({e.msg} at line {e.lineno}); "
                        "it may be cut off, capture it again") from None
    traces = [d for d in docs if isinstance(d, dict) and isinstance(d.get("nodes"), list)]
    if not traces or not all(k in traces[0] for k in ("schema", "pid")):
        raise UserError(f"{source} is not a PyTorch host execution trace (no 'schema', 'pid' and 'nodes')")
    repairs = []
    if len(docs) > 1:
        repairs.append(f"kept the largest of {len(docs)} JSON documents found back to back")
    trace = max(traces, key=lambda d: len(d["nodes"]))
    seen, nodes = set(), []
    for node in trace["nodes"]:
        if not isinstance(node, dict) or not {"id", "name", "ctrl_deps", "inputs", "outputs"} <= node.keys():
            raise UserError(f"{source}: a node lacks id/name/ctrl_deps/inputs/outputs; not a host execution trace")
        if node["id"] not in seen:
            seen.add(node["id"])
            nodes.append(node)
    if len(nodes) < len(trace["nodes"]):
        repairs.append(f"dropped {len(trace['nodes']) - len(nodes)} nodes with duplicated ids")
    return {**trace, "nodes": nodes}, repairs


def read_host_trace(path) -> tuple[dict, list[str]]:
    path = Path(path)
    return repair_host_trace(_read_text(path, "host trace"), source=f"host trace {path}")


def read_device_trace(path) -> dict:
    """The Kineto trace, checked to be one (it must hold traceEvents with the profiler's CPU ops)."""
    path = Path(path)
    try:
        trace = json.loads(_read_text(path, "device trace"))
    except json.JSONDecodeError as e:
        raise UserError(f"device trace {path} is not valid JSON ({e.msg} at line {e.lineno}); "
                        "it may be cut off, capture it again") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise UserError(f"device trace {path} is not a Kineto trace (no 'traceEvents' list)")
    if not any(isinstance(e, dict) and e.get("cat") == "cpu_op" for e in trace["traceEvents"]):
        raise UserError(f"device trace {path} holds no cpu_op events; record it with torch.profiler's CPU activity")
    return trace


def trace_rank(device_trace: dict) -> int | None:
    info = device_trace.get("distributedInfo")
    return info.get("rank") if isinstance(info, dict) else None


def device_pid(device_trace: dict):
    return next((e.get("pid") for e in device_trace["traceEvents"] if isinstance(e, dict) and e.get("cat") == "cpu_op"), None)


def check_same_rank(host: dict, device: dict, rank: int, host_path, device_path) -> None:
    """The host and device traces must come from the same process, and that process must be `rank`."""
    found = trace_rank(device)
    if found is not None and found != rank:
        raise UserError(f"device trace {device_path} is from rank {found}, not rank {rank}; "
                        "give --rank to match or the device trace of that rank")
    if device_pid(device) != host["pid"]:
        raise UserError(f"host trace {host_path} is from process {host['pid']} but device trace {device_path} "
                        f"from process {device_pid(device)}; give the two traces of the same rank and run")


def comm_groups(device: dict) -> dict[str, list[int]]:
    """Process groups recorded by the profiler (pg_name -> global ranks), as the Kineto trace lists them."""
    info = device.get("distributedInfo") or {}
    groups = {}
    for pg in info.get("pg_config") or []:
        if isinstance(pg, dict) and "pg_name" in pg and isinstance(pg.get("ranks"), list):
            groups[str(pg["pg_name"])] = [int(r) for r in pg["ranks"]]
    return groups


def tensor_refs(io: dict):
    """(storage id, bytes) of each tensor in a host-trace inputs/outputs record."""
    for value, typ in zip(io.get("values", []), io.get("types", [])):
        if not isinstance(typ, str) or "Tensor" not in typ:
            continue
        for t in value if typ.startswith("GenericList") else [value]:
            # a tensor is [tensor id, storage id, offset, numel, element bytes, device]
            if isinstance(t, list) and len(t) >= 5:
                yield t[1], t[3] * t[4]
