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


# what each format is written to: a file with one of these suffixes, or (FOLDER) a folder; chakra's folder
# may also be given as the path of its JSON form (seed 000: --output model.json), the .et files beside it
FOLDER = ""
WRITTEN_TO = {"json": (".json",), "png": (".png",), "svg": (".svg",), "graphml": (".graphml",),
              "perfetto": (".json",), "chakra": (FOLDER, ".json")}
FILE_SUFFIXES = {".json", ".png", ".svg", ".graphml", ".et"}  # never a chakra folder's name
NAMED_BY_SUFFIX = {".json": "json", ".png": "png", ".svg": "svg", ".graphml": "graphml"}  # without --format


def output_format(path, fmt: str | None = None) -> str:
    """The format `syntorch export` writes `path` in: --format `fmt` when it fits the path, else (no `fmt`)
    the format the path's suffix names. One line when they disagree or nothing names a format, so a
    .png never holds SVG."""
    suffix = Path(path).suffix.lower()
    if fmt is None:
        if suffix not in NAMED_BY_SUFFIX:
            raise UserError(f"--output {path} does not end in a format's suffix ({', '.join(NAMED_BY_SUFFIX)}); "
                            f"give --format, one of {', '.join(EXPORTERS)} (chakra writes a folder)")
        return NAMED_BY_SUFFIX[suffix]
    exporter(fmt)  # an unknown format is named first
    kinds = WRITTEN_TO[fmt]
    fits = suffix in kinds or (FOLDER in kinds and suffix not in FILE_SUFFIXES)
    if not fits:
        where = " or ".join("a folder" if k == FOLDER else f"a {k} file" for k in kinds)
        raise UserError(f"--format {fmt} is written to {where}, but --output is {path}; make them agree "
                        f"(without --format the suffix names the format)")
    return fmt


def exporter(fmt: str):
    if fmt not in EXPORTERS:
        raise UserError(f"unknown --format {fmt!r}; use one of {', '.join(EXPORTERS)}")
    module, function = EXPORTERS[fmt].split(":")
    return getattr(importlib.import_module(module), function)


def write_trace_outputs(graph, out_dir, level: str | None = None) -> dict:
    """What `syntorch infer --visualize_trace` writes into `out_dir`: tensor_trace_graph.json (the whole
    graph, at op level, so any level can be drawn later), tensor_trace_graph.png (at `level`, or the finest
    readable one), and for a run with collectives tensor_comm_graph.png. Returns {file: level drawn}."""
    from syntorch.export import image, networkx_json
    out_dir = Path(out_dir)
    networkx_json.export(graph, out_dir / "tensor_trace_graph.json")
    folded = image.fold(graph)
    drawn = image.draw(graph, out_dir / "tensor_trace_graph.png", level, folded=folded)
    written = {"tensor_trace_graph.json": "op", "tensor_trace_graph.png": drawn.graph["level"]}
    if any(True for _ in graph.collectives()):
        comm = image.draw(graph, out_dir / "tensor_comm_graph.png", level, comm=True, folded=folded)
        written["tensor_comm_graph.png"] = comm.graph["level"]
    return written
