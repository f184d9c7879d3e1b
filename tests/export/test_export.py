import json
import xml.etree.ElementTree as ET

import networkx as nx
import pytest
import torch

from conftest import tiny_config
from syntorch.cli import main
from syntorch.errors import UserError
from syntorch.export import graphml, networkx_json, perfetto, write_trace_outputs
from syntorch.export.image import READABLE_NODES, choose_level
from syntorch.models import build_model
from syntorch.trace import Tracer


@pytest.fixture(scope="module")
def graph():
    """A traced tiny GPT-2 forward with an all-reduce after it, as a TP rank would have."""
    model = build_model(tiny_config("gpt2"))
    with Tracer(model, rank=1, world_size=2, meta={"model": "tiny-gpt2", "tp": 2}) as tracer:
        model(torch.randint(0, 128, (1, 6)))
    g = tracer.graph
    logits = max(n for n, d in g.tensors())
    out = g.add_tensor(g.nodes[logits]["shape"], "float32", g.nodes[logits]["bytes"])
    g.add_collective("all_reduce", [logits], [out], group=[0, 1], nbytes=g.nodes[logits]["bytes"],
                     reduce_op="sum", module="lm_head", phase="forward")
    return g


def same(a, b):
    assert dict(a.nodes(data=True)) == dict(b.nodes(data=True))
    assert list(a.edges(data=True)) == list(b.edges(data=True))
    assert a.graph == b.graph


def test_networkx_json_round_trips(graph, tmp_path):
    networkx_json.export(graph, tmp_path / "g.json")
    loaded = networkx_json.load(tmp_path / "g.json")
    same(loaded, graph)
    assert loaded.total_flops() == graph.total_flops() and list(loaded.op_deps().items()) == list(graph.op_deps().items())
    raw = json.loads((tmp_path / "g.json").read_text())
    assert {"nodes", "edges", "graph"} <= raw.keys() and raw["graph"]["tp"] == 2


@pytest.mark.parametrize("batch", [1, 7, 10**6])  # batches that split nodes and edges unevenly, or not at all
def test_networkx_json_is_node_link_data_byte_for_byte(graph, tmp_path, monkeypatch, batch):
    monkeypatch.setattr(networkx_json, "BATCH", batch)
    networkx_json.export(graph, tmp_path / "g.json")
    expected = json.dumps(nx.node_link_data(graph, edges="edges"), separators=(",", ":"))
    assert (tmp_path / "g.json").read_text() == expected


def test_graphml_round_trips_every_attribute(graph, tmp_path):
    graphml.export(graph, tmp_path / "g.graphml")
    plain = nx.read_graphml(tmp_path / "g.graphml", node_type=int)  # what other tools see
    tensor = next(n for n, d in graph.tensors())
    assert len(plain) == len(graph) and isinstance(plain.nodes[tensor]["shape"], str)
    loaded = graphml.load(tmp_path / "g.graphml")
    same(loaded, graph)
    (coll,) = [d for _, d in loaded.collectives()]
    assert coll["group"] == [0, 1] and coll["src"] is None and coll["reduce_op"] == "sum"


def test_svg_is_valid_xml_and_png_is_a_png(graph, tmp_path):
    main(["export", "--input", str(_saved(graph, tmp_path)), "--output", str(tmp_path / "g.svg"), "--format", "svg"])
    root = ET.parse(tmp_path / "g.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    text = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "tiny-gpt2" in text and "all_reduce [0, 1]" in text
    main(["export", "--input", str(tmp_path / "g.json"), "--output", str(tmp_path / "g.png"), "--format", "png"])
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_perfetto_is_the_simulated_timeline(graph, tmp_path):
    """The export runs the graph through the simulator with the cost model's durations: the predicted run
    (syntorch infer's run.json), one process for the two TP ranks that run the graph, a track per stream."""
    from syntorch.hardware import load_hw_config
    from syntorch.simulate.prediction import predict_inference
    from syntorch.trace.cost import fill_durations

    costed = graph.copy()  # the export sets the cost model's durations on the graph it is given
    perfetto.export({0: costed, 1: costed}, tmp_path / "t.json", hw_config="h100-sxm")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")}
    assert names == {"ranks 0-1 (2 ranks)", "compute", "comm ranks 0,1"}
    timed = graph.copy()
    fill_durations(timed, load_hw_config("h100-sxm"))
    kernels = [d for _, d in timed.work() if d["duration_us"] or d["kind"] == "collective"]  # views launch nothing
    assert [e["dur"] for e in slices] == pytest.approx([d["duration_us"] for d in kernels])
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(
        predict_inference({0: timed, 1: timed}, "h100-sxm").summary["latency_ms"] * 1e3)
    reduce = slices[-1]
    assert reduce["args"]["collective"] == "all_reduce" and reduce["args"]["group"] == [0, 1] and reduce["tid"] == 1
    with pytest.raises(UserError, match="the graph has no durations"):
        perfetto.export(graph, tmp_path / "u.json")


def test_perfetto_uses_known_durations(graph):
    timed = graph.copy()
    for _, d in timed.work():
        d["duration_us"] = 3.0
    slices = [e for e in perfetto.trace_events(timed)["traceEvents"] if e["ph"] == "X"]
    assert {e["dur"] for e in slices} == {3.0}
    assert slices[-1]["ts"] == 3.0 * (len(slices) - 1)  # every op, then the all-reduce of their result


def test_trace_outputs_and_comm_graph(graph, tmp_path):
    written = write_trace_outputs(graph, tmp_path)
    assert written == {"tensor_trace_graph.json": "op", "tensor_trace_graph.png": "op", "tensor_comm_graph.png": "op"}
    for name in written:
        assert (tmp_path / name).stat().st_size > 1000


def test_big_graphs_are_drawn_coarser(graph):
    assert choose_level(graph, None).graph["level"] == "op"
    big = build_model(tiny_config("gpt2", n_layer=8))
    with Tracer(big) as tracer:
        big(torch.randint(0, 128, (1, 4)))
    assert len(tracer.graph) > READABLE_NODES
    view = choose_level(tracer.graph, None)
    assert view.graph["level"] == "module" and len(view) <= READABLE_NODES
    assert choose_level(tracer.graph, "layer").graph["level"] == "layer"


def _saved(graph, tmp_path):
    networkx_json.export(graph, tmp_path / "g.json")
    return tmp_path / "g.json"


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_infer_visualize_trace_writes_the_seed_files(tmp_path, device):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"name": "tiny-gpt3", "n_layer": 3, "d_model": 64, "n_head": 4, "d_head": 16,
                                  "d_ff": 256, "vocab_size": 128, "n_positions": 64}))
    out = tmp_path / "run"
    assert main(["infer", "--model", "gpt3-125m", "--model_config", str(config), "--device", device,
                 "--num_input_tokens", "5", "--num_output_tokens", "3", "--visualize_trace", "--out", str(out)]) == 0
    graph = networkx_json.load(out / "tensor_trace_graph.json")
    assert graph.graph["model"] == "tiny-gpt3"
    assert {d["phase"] for _, d in graph.ops()} == {"prefill", "decode[0]", "decode[1]"}
    assert {d["module"] for _, d in graph.ops() if d["module"].endswith("mlp.fc2")} == {
        f"layers.{i}.mlp.fc2" for i in range(3)}
    assert (out / "tensor_trace_graph.png").read_bytes()[:4] == b"\x89PNG"
    run = json.loads((out / "run.json").read_text())
    assert run["trace"]["nodes"] == len(graph) and run["trace"]["flops"] == graph.total_flops()


def test_output_piped_into_a_reader_that_stops_is_no_traceback(graph, tmp_path):
    """`syntorch comm ... | head -1`: the reader closes the pipe; exit 1 quietly, no traceback."""
    import subprocess
    import sys
    networkx_json.export(graph, tmp_path / "g.json")
    command = [sys.executable, "-c", "from syntorch.cli import run_main; run_main()", "comm", "--input",
               str(tmp_path / "g.json"), "--noise_level", "3", "--html", str(tmp_path / "c.html")]
    writer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    writer.stdout.close()  # as `head` does once it has read enough; here before the first write, so no race
    err = writer.stderr.read().decode()
    assert writer.wait(timeout=120) == 1 and "Traceback" not in err, err
