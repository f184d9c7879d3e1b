"""One rank's host + device traces -> `<prefix>.<rank>.et` for ASTRA-sim, with the official tools:
repair the host trace, link it with the device trace (chakra_trace_link's TraceLinker), convert the
linked JSON (chakra_converter PyTorch's PyTorchConverter), then fix what they leave wrong (repair.py).
"""
import contextlib
import importlib.util
import json
import logging
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

from chakra.src.third_party.utils.protolib import encodeMessage

from syntorch.capture import traces
from syntorch.capture.peers import p2p_ops
from syntorch.capture.repair import Communication, drop_forward_inter_thread_deps, fix_nodes
from syntorch.chakra.reader import check_trace_name, read_trace
from syntorch.errors import UserError
from syntorch.outdir import atomic_output_file


CAPTURE_EXTRA = "pip install -e '.[capture]' (holistictraceanalysis, which the official linker needs)"


def check_capture_tools() -> None:
    """Capturing needs the optional [capture] extra; say so in one line before any run starts."""
    if importlib.util.find_spec("hta") is None:
        raise UserError(f"capturing real runs needs the capture tools: {CAPTURE_EXTRA}")


def _param_bench() -> Path:
    # chakra_trace_link imports et_replay, which PyPI ships only inside holistictraceanalysis's wheel,
    # as a top-level `param_bench/et_replay` folder beside `hta`
    check_capture_tools()
    spec = importlib.util.find_spec("hta")
    return Path(spec.origin).parents[1] / "param_bench"


def official_tools():
    """(TraceLinker, PyTorchConverter) from mlc-chakra."""
    path = str(_param_bench())
    if path not in sys.path:
        sys.path.insert(0, path)
    from chakra.src.converter.pytorch_converter import PyTorchConverter
    from chakra.src.trace_link.trace_linker import TraceLinker
    return TraceLinker, PyTorchConverter


@contextlib.contextmanager
def _tool_step(what: str, source: str):
    """Run an official tool quietly (HTA logs a pandas error on every CPU trace and carries on, see
    README) and turn its failure into one line naming the input."""
    logging.disable(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # HTA's pandas deprecation warnings, one per call
            yield
    except (UserError, KeyboardInterrupt):
        raise
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:300]
        raise UserError(f"{what} failed on {source}: {type(e).__name__}: {first}") from None
    finally:
        logging.disable(logging.NOTSET)


def link_and_convert(rank: int, host_path: Path, device_path: Path, workdir: Path) -> tuple[Path, dict, Path, int]:
    """Runs the two official tools; returns (linked JSON file, its content, converted .et, inter-thread
    dependencies dropped between the two to keep the converter from a cycle)."""
    TraceLinker, PyTorchConverter = official_tools()
    merged, raw = workdir / "merged.json", workdir / "official.et"
    with _tool_step("chakra_trace_link", f"{host_path} + {device_path}"):
        # absolute paths: with a relative device path the linker doubles its folder
        TraceLinker().link(rank, str(host_path.resolve()), str(device_path.resolve()), str(merged.resolve()))
    linked = json.loads(merged.read_text())
    dropped = drop_forward_inter_thread_deps(linked["nodes"])
    if dropped:
        merged.write_text(json.dumps(linked))
    with _tool_step("chakra_converter PyTorch", str(host_path)):
        PyTorchConverter().convert(str(merged), str(raw), False)
    return merged, linked, raw, dropped


def convert_rank(host_path, device_path, rank: int, output, merged_output=None, comm_groups_output=None,
                 collectives=None, peers=None) -> dict:
    """Writes the ASTRA-sim-ready `output` (`<prefix>.<rank>.et`) for one rank; with `merged_output` also the
    linked host + device JSON, with `comm_groups_output` the comm-group JSON: all whole, or none at all.
    `collectives`: (profiling name, process group name) of the rank's collectives in issue order, from the
    flight recorder (flight_recorder.py); `peers`: (global peer, group name) or None of its sends and recvs
    in issue order (peers.py). Without them, collectives go to the default group and sends and recvs stay
    compute nodes, with a note. Returns a summary (nodes, collectives, bytes, repairs, notes, groups)."""
    check_trace_name(output, rank)
    host_path, device_path, output = Path(host_path), Path(device_path), Path(output)
    host, repairs = traces.read_host_trace(host_path)
    device = traces.read_device_trace(device_path)
    traces.check_same_rank(host, device, rank, host_path, device_path)
    groups = traces.comm_groups(device)
    with contextlib.ExitStack() as outputs, tempfile.TemporaryDirectory(prefix=".syntorch-convert-") as tmp:
        tmp = Path(tmp)
        # every output's temporary first: a refused path stops the run before the tools, and before any output
        et_out = outputs.enter_context(atomic_output_file(output))
        merged_out = outputs.enter_context(atomic_output_file(merged_output, "--merged")) if merged_output else None
        groups_out = (outputs.enter_context(atomic_output_file(comm_groups_output, "--comm_groups"))
                      if comm_groups_output else None)
        if repairs:
            host_path = tmp / "host_repaired.json"
            host_path.write_text(json.dumps(host))
        merged, linked, raw, dropped = link_and_convert(rank, host_path, device_path, tmp)
        header, nodes = read_trace(raw)
        comm = Communication(rank, groups, collectives, linked_peers(linked["nodes"], peers or []))
        nodes, summary = fix_nodes(nodes, {n["id"]: n for n in linked["nodes"]}, comm)
        with open(et_out, "wb") as f:
            encodeMessage(f, header)
            for node in nodes:
                encodeMessage(f, node)
        if merged_out:
            shutil.copyfile(merged, merged_out)
        if groups_out:
            groups_out.write_text(comm_groups_text(groups))
    if dropped:
        repairs.append(f"dropped {dropped} inter-thread dependencies that pointed forward (the converter would stop on a cycle)")
    return {"rank": rank, "output": str(output), "nodes": len(nodes), **summary, "repairs": repairs, "groups": groups}


def linked_peers(linked_nodes: list[dict], peers: list) -> dict[int, tuple[int, str]]:
    """The linked trace's send/recv op ids -> (global peer, group), `peers` given in issue order."""
    ops = p2p_ops(linked_nodes)
    return {node_id: peer for (node_id, _), peer in zip(ops, peers) if peer is not None} if len(ops) == len(peers) else {}


def comm_groups_text(groups: dict[str, list[int]]) -> str:
    """comm_groups.json for ASTRA-sim's --comm-group-configuration: every group but the default one
    ("0" means all ranks to ASTRA-sim and is not listed)."""
    listed = {k: v for k, v in sorted(groups.items()) if k != "0" and k.isdigit()}
    return json.dumps(listed) + "\n"


def write_comm_groups(groups: dict[str, list[int]], path, flag: str = "--comm_groups") -> None:
    with atomic_output_file(path, flag) as out:
        Path(out).write_text(comm_groups_text(groups))
