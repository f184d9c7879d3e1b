import re
import xml.etree.ElementTree as ET

import networkx as nx
import pytest
import torch
from PIL import Image
from torch import nn

from conftest import tiny_config
from syntorch.export import networkx_json, write_trace_outputs
from syntorch.export.image import draw
from syntorch.models import build_model
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.generation import trace_tp_rank
from syntorch.trace.training import trace_stage
from syntorch.trace import Tracer
from syntorch.trace.folds import fold_repeated_layers
from syntorch.trace.graph import LEVELS
from syntorch.trace.levels import layer_of


def traced(n_layer: int, device: str = "cpu", change=None):
    """A traced forward of a tiny GPT-2 with `n_layer` layers; `change(model)` may alter it first."""
    with torch.device(device):
        model = build_model(tiny_config("gpt2", n_layer=n_layer))
    if change:
        change(model)
    with Tracer(model, meta={"model": f"tiny-gpt2-{n_layer}"}) as tracer:
        model(torch.randint(0, 128, (1, 6), device=device))
    return tracer.graph


def layers_kept(graph) -> list[str]:
    return list(dict.fromkeys(layer_of(d["module"]) for _, d in graph.work() if d["module"].startswith("layers.")))


def test_identical_layers_fold_into_one_with_their_count():
    graph = traced(6)
    folded, repeats = fold_repeated_layers(graph)
    assert repeats == {("forward", "layers.0", 0): [f"layers.{i}" for i in range(6)]}
    assert layers_kept(folded) == ["layers.0"]
    assert nx.is_directed_acyclic_graph(folded) and nx.is_weakly_connected(folded)
    one_layer = [n for n, d in graph.work() if layer_of(d["module"]) == "layers.0"]
    assert len(list(folded.work())) == len(list(graph.work())) - 5 * len(one_layer)
    # what fed layers.0 and what read layers.5 still connect through the kept copy
    (ln_f,) = [n for n, d in folded.ops() if d["module"] == "ln_f"]
    assert any(layer_of(folded.nodes[p]["module"]) == "layers.0" for p in folded.op_deps()[ln_f])


def test_a_layer_that_differs_is_kept_on_its_own(tmp_path):
    def no_bias(model):  # layers.2's fc1 runs aten.mm instead of aten.addmm
        model.layers["2"].mlp.fc1 = nn.Linear(64, 256, bias=False)

    graph = traced(5, change=no_bias)
    folded, repeats = fold_repeated_layers(graph)
    assert layers_kept(folded) == ["layers.0", "layers.2", "layers.3"]
    assert repeats == {("forward", "layers.0", 0): ["layers.0", "layers.1"],
                       ("forward", "layers.3", 0): ["layers.3", "layers.4"]}
    draw(graph, tmp_path / "g.svg", "module")
    text = svg_text(tmp_path / "g.svg")
    assert "layers.0–1 × 2" in text and "layers.3–4 × 2" in text and "layers.2.mlp.fc1" in text


@pytest.mark.parametrize("field", ["flops", "shape"])
def test_a_hand_changed_layer_is_kept_on_its_own(field):
    graph = traced(5)
    fc1 = next(n for n, d in graph.ops() if d["module"] == "layers.2.mlp.fc1")
    if field == "flops":
        graph.nodes[fc1]["flops"] += 1
    else:
        (out,) = graph.successors(fc1)
        graph.nodes[out]["shape"] = [1, 2, 3]
    folded, _ = fold_repeated_layers(graph)
    assert layers_kept(folded) == ["layers.0", "layers.2", "layers.3"]


def test_folding_leaves_the_graph_alone():
    graph = traced(3)
    before = (len(graph), graph.number_of_edges(), dict(graph.nodes(data=True)))
    fold_repeated_layers(graph)
    assert before == (len(graph), graph.number_of_edges(), dict(graph.nodes(data=True)))


def tp_trace(n_layer: int):
    """Rank 0 of a tiny GPT-2 generating under TP 2 on meta: two all-reduces per layer and step."""
    return trace_tp_rank(tiny_config("gpt2", n_layer=n_layer), torch.zeros(1, 8, dtype=torch.long), 2, tp=2,
                         rank=0)[0]


@pytest.fixture(scope="module")
def tp_96_layers():
    return tp_trace(96)


def svg_text(path) -> str:
    return " ".join(t.text or "" for t in ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}text"))


@pytest.mark.parametrize("comm", [False, True])
def test_a_96_layer_model_draws_its_layers_once_on_a_page(tp_96_layers, tmp_path, comm):
    view = draw(tp_96_layers, tmp_path / "g.png", comm=comm)
    assert layers_kept(view) == ["layers.0"]
    width, height = Image.open(tmp_path / "g.png").size
    draw(tp_trace(3), tmp_path / "three.png", comm=comm)
    assert Image.open(tmp_path / "three.png").size[1] == height <= 3000 and width <= 3000, (width, height)
    draw(tp_96_layers, tmp_path / "g.svg", comm=comm)
    text = svg_text(tmp_path / "g.svg")
    assert text.count("layers.0–95 × 96") == 2  # prefill and the one decode step
    assert "all_reduce [0, 1]" in text


@pytest.mark.parametrize("level", LEVELS)
def test_every_level_is_drawn_folded(level, tmp_path):
    graph = traced(6)
    view = draw(graph, tmp_path / "g.svg", level)
    assert view.graph["level"] == level and layers_kept(view) == ["layers.0"]
    assert "layers.0–5 × 6" in svg_text(tmp_path / "g.svg")


def test_the_json_keeps_every_layer(tp_96_layers, tmp_path):
    nodes = len(tp_96_layers)
    written = write_trace_outputs(tp_96_layers, tmp_path)
    assert set(written) == {"tensor_trace_graph.json", "tensor_trace_graph.png", "tensor_comm_graph.png"}
    saved = networkx_json.load(tmp_path / "tensor_trace_graph.json")
    assert len(saved) == len(tp_96_layers) == nodes
    assert layers_kept(saved) == [f"layers.{i}" for i in range(96)]


def test_backward_layers_fold_too(tmp_path):
    model = build_model(tiny_config("gpt2", n_layer=4)).train()
    with Tracer(model) as tracer:
        model(torch.randint(0, 128, (2, 8))).sum().backward()
    _, repeats = fold_repeated_layers(tracer.graph)
    assert repeats[("backward", "layers.3", 0)] == ["layers.3", "layers.2", "layers.1", "layers.0"]
    draw(tracer.graph, tmp_path / "g.svg")
    assert svg_text(tmp_path / "g.svg").count("layers.0–3 × 4") == 2  # forward and backward


def test_a_pipeline_stage_labels_each_micro_batch_with_its_own_layers(tmp_path):
    """Stage 0 of 2 of a 12-layer model runs layers.0-5 once per micro-batch, all in phase forward (and
    backward): each micro-batch's copy is a box of 6 layers, not one count of every micro-batch's layers."""
    plan = TrainPlan(pp=2, microbatches=4, micro_batch_size=1, seq=8)
    graph = trace_stage(tiny_config("gpt2", n_layer=12), plan, 0)
    _, repeats = fold_repeated_layers(graph)
    assert {key: len(layers) for key, layers in repeats.items()} == {
        **{("forward", "layers.0", m): 6 for m in range(4)}, **{("backward", "layers.5", m): 6 for m in range(4)}}
    draw(graph, tmp_path / "g.svg", "layer")
    text = svg_text(tmp_path / "g.svg")
    assert re.findall(r"layers\.\d+–\d+ × \d+", text) == ["layers.0–5 × 6"] * 8
