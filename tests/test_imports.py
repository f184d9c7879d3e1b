"""Data flows one way (DESIGN.md): a module never imports one above it, not even inside a function, and no
modules import each other in a cycle. Read from the source with ast, so it stays true as the code changes."""
import ast
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "syntorch"

# lowest first; a module may import its own layer (without a cycle) and the layers below it
LAYERS = [
    ("base", ["syntorch.errors", "syntorch.version", "syntorch.userfiles", "syntorch.outdir", "syntorch.console",
              "syntorch.options", "syntorch.nodynamo"]),
    ("config", ["syntorch.config", "syntorch.hardware"]),
    ("models", ["syntorch.models", "syntorch.decode_capture", "syntorch.generate", "syntorch.beam_search", "syntorch.fill_mask", "syntorch.checkpoints", "syntorch.hf_format",
                "syntorch.hf_family", "syntorch.hf_deepseek", "syntorch.hf_recent", "syntorch.hf_stacked",
                "syntorch.hf_values"]),
    ("parallel", ["syntorch.parallel", "syntorch.quant"]),
    ("trace", ["syntorch.trace"]),
    ("writers", ["syntorch.chakra", "syntorch.export"]),
    # reads TraceGraphs and Chakra files, predicts for the runs above; the Perfetto export is its timeline
    ("simulate", ["syntorch.simulate", "syntorch.export.perfetto"]),
    ("runs", ["syntorch.inference", "syntorch.shard_files", "syntorch.workload", "syntorch.train", "syntorch.capture", "syntorch.comm_debug",
              "syntorch.plan"]),
    ("cli", ["syntorch.cli"]),
    ("package", ["syntorch"]),  # its __init__ (lazy CommDebugMode for users)
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, source: str | None = None) -> set[str]:
    """Every syntorch module `path` imports, at top level or inside functions (`from a import b` counts as
    a.b when a.b is a module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.update(f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names)
    return {m for m in found if m == "syntorch" or m.startswith("syntorch.")}


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def layer_of(module: str) -> int:
    matches = [(len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} belongs to no layer; add it to LAYERS in {__file__}"
    return max(matches)[1]


def import_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    for path in PACKAGE.rglob("*.py"):
        graph.add_node(module_name(path))
        graph.add_edges_from((module_name(path), target) for target in imports_of(path))
    return graph


def test_no_module_imports_a_layer_above_it():
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
              for a, b in import_graph().edges if layer_of(b) > layer_of(a)]
    assert upward == []


def test_no_import_cycles_between_modules_or_packages():
    graph = import_graph()
    assert list(nx.simple_cycles(graph)) == []
    packages = nx.DiGraph((a.rsplit(".", 1)[0] if a.count(".") > 1 else a, b.rsplit(".", 1)[0] if b.count(".") > 1 else b)
                          for a, b in graph.edges)
    packages.remove_edges_from(nx.selfloop_edges(packages))
    assert list(nx.simple_cycles(packages)) == []


@pytest.mark.parametrize("source, expected", [
    ("from syntorch.trace.graph import TraceGraph", {"syntorch.trace.graph"}),
    ("def f():\n    from syntorch.export import image", {"syntorch.export.image"}),
    ("import syntorch.chakra.writer", {"syntorch.chakra.writer"}),
])
def test_the_scan_sees_imports_inside_functions_and_submodules(source, expected):
    """The scanner itself: an upward import in a model file, even hidden in a function, would be caught."""
    path = PACKAGE / "models" / "_scan_probe.py"
    assert imports_of(path, source) == expected
    assert any(layer_of(m) > layer_of("syntorch.models._scan_probe") for m in expected)
