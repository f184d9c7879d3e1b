"""Writers of a TraceGraph, one module per format. Each has `export(graph, path, level=...)`.

EXPORTERS maps a `--format` name to "module:function", imported only when used (matplotlib and the
Chakra protobufs are slow to import).
"""
import importlib
from pathlib import Path

from syntorch.errors import UserError

EXPORTERS = {
    "json": "syntorch.export.networkx_json:export",
    "png": "syntorch.export.image:export_png",
    "svg": "syntorch.export.image:export_svg",
    "graphml": "syntorch.export.graphml:export",
    "perfetto": "syntorch.export.perfetto:export",
    "chakra": "syntorch.chakra.writer:export",
}


def exporter(fmt: str):
    if fmt not in EXPORTERS:
        raise UserError(f"unknown format {fmt!r}; use one of {', '.join(EXPORTERS)}")
    module, function = EXPORTERS[fmt].split(":")
    return getattr(importlib.import_module(module), function)


def write_trace_outputs(graph, out_dir, level: str | None = None) -> dict:
    """What `syntorch infer --visualize_trace` writes into `out_dir`: tensor_trace_graph.json (the whole
    graph, at op level, so any level can be drawn later), tensor_trace_graph.png (at `level`, or the finest
    readable one), and for a run with collectives tensor_comm_graph.png. Returns {file: level drawn}."""
    from syntorch.export import image, networkx_json
    out_dir = Path(out_dir)
    networkx_json.export(graph, out_dir / "tensor_trace_graph.json")
    drawn = image.draw(graph, out_dir / "tensor_trace_graph.png", level)
    written = {"tensor_trace_graph.json": "op", "tensor_trace_graph.png": drawn.graph["level"]}
    if any(True for _ in graph.collectives()):
        comm = image.draw(graph, out_dir / "tensor_comm_graph.png", level, comm=True)
        written["tensor_comm_graph.png"] = comm.graph["level"]
    return written
