import networkx as nx
import pytest
import torch

from conftest import tiny_config
from syntorch.generate import Sampling
from syntorch.models import build_model
from syntorch.trace import Tracer, trace_generation
from syntorch.trace.levels import layer_of, level_view


@pytest.fixture(scope="module")
def training_graph():
    model = build_model(tiny_config("gpt2")).train()
    with Tracer(model) as tracer:
        model(torch.randint(0, 128, (2, 8))).sum().backward()
    return tracer.graph


def test_layer_of():
    assert layer_of("layers.11.attn.qkv") == "layers.11"
    assert layer_of("layers.3") == "layers.3"
    assert layer_of("lm_head") == "lm_head" and layer_of("") == ""


@pytest.mark.parametrize("level", ["module", "layer"])
def test_levels_keep_flops_bytes_and_phases(training_graph, level):
    view = level_view(training_graph, level)
    assert view.graph["level"] == level and training_graph.graph["level"] == "op"
    assert nx.is_directed_acyclic_graph(view)
    for field in ("flops", "bytes_read", "bytes_written"):
        for phase in ("forward", "backward"):
            assert sum(d[field] for _, d in view.ops() if d["phase"] == phase) == \
                sum(d[field] for _, d in training_graph.ops() if d["phase"] == phase)
    assert sum(d["num_ops"] for _, d in view.ops()) == len(list(training_graph.ops()))
    assert not any(d["is_param"] for _, d in view.tensors())


def test_module_level_has_one_node_per_linear_call(training_graph):
    view = level_view(training_graph, "module")
    fc1 = [d for _, d in view.ops() if d["module"] == "layers.0.mlp.fc1" and d["phase"] == "forward"]
    assert len(fc1) == 1 and fc1[0]["flops"] == 2 * 64 * 256 * 16 and fc1[0]["name"] == "layers.0.mlp.fc1"
    # fc1's forward node reads ln2's output and its output feeds the gelu of layers.0.mlp
    (ln2,) = [n for n, d in view.ops() if d["module"] == "layers.0.ln2" and d["phase"] == "forward"]
    (fc1_node,) = [n for n, d in view.ops() if d["module"] == "layers.0.mlp.fc1" and d["phase"] == "forward"]
    assert view.op_deps()[fc1_node] == [ln2]


def test_layer_level_of_a_generation():
    model = build_model(tiny_config("gpt2"))
    graph, _ = trace_generation(model, torch.randint(0, 128, (1, 4)), 3, Sampling(temperature=0))
    view = level_view(graph, "layer")
    names = [d["name"] for _, d in view.ops() if d["phase"] == "decode[1]"]
    assert names[names.index("layers.0"):names.index("layers.1") + 1] == ["layers.0", "layers.1"]
    assert {d["phase"] for _, d in view.ops()} == {"prefill", "decode[0]", "decode[1]"}
    assert view.total_flops() == graph.total_flops()
    assert len(view) < len(graph) / 4
