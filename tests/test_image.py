import networkx as nx
import pytest
import torch
from torch import nn

from conftest import tiny_config
from syntorch.models import build_model
from syntorch.trace import Tracer
from syntorch.trace.levels import fold_repeated_layers, layer_of


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
    assert repeats == {("forward", "layers.0"): [f"layers.{i}" for i in range(6)]}
    assert layers_kept(folded) == ["layers.0"]
    assert nx.is_directed_acyclic_graph(folded) and nx.is_weakly_connected(folded)
    one_layer = [n for n, d in graph.work() if layer_of(d["module"]) == "layers.0"]
    assert len(list(folded.work())) == len(list(graph.work())) - 5 * len(one_layer)
    # what fed layers.0 and what read layers.5 still connect through the kept copy
    (ln_f,) = [n for n, d in folded.ops() if d["module"] == "ln_f"]
    assert any(layer_of(folded.nodes[p]["module"]) == "layers.0" for p in folded.op_deps()[ln_f])


def test_a_layer_that_differs_is_kept_on_its_own():
    def no_bias(model):  # layers.2's fc1 runs aten.mm instead of aten.addmm
        model.layers["2"].mlp.fc1 = nn.Linear(64, 256, bias=False)

    folded, repeats = fold_repeated_layers(traced(5, change=no_bias))
    assert layers_kept(folded) == ["layers.0", "layers.2", "layers.3"]
    assert repeats == {("forward", "layers.0"): ["layers.0", "layers.1"],
                       ("forward", "layers.3"): ["layers.3", "layers.4"]}


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
