"""Chakra .et traces: what the official mlc-chakra tools read back from our files."""
import functools
import json
import sys

import pytest
import torch
from chakra.schema.protobuf import et_def_pb2 as et
from chakra.src.jsonizer import jsonizer
from google.protobuf.json_format import MessageToDict

from syntorch.errors import UserError
from syntorch.chakra.groups import graph_group_ids
from syntorch.chakra.nodes import chakra_nodes, to_json, to_proto
from syntorch.chakra.writer import write_chakra
from syntorch.hardware import load_hw_config
from syntorch.trace.cost import fill_durations
from syntorch.trace.graph import RankTraces
from syntorch.chakra.validator import validate_traces
from chakra_graphs import F32, attrs, pp_rank, read_et, tp_rank

@pytest.fixture
def tp_traces(tmp_path):
    summary = write_chakra({r: tp_rank(r) for r in range(2)}, tmp_path / "chakra")
    return tmp_path / "chakra", summary


def test_official_reader_sees_every_rank(tp_traces):
    out, summary = tp_traces
    assert sorted(p.name for p in out.iterdir()) == [".syntorch.json", "comm_groups.json", "tensor_trace_chakra.json",
                                                     "toy.0.et", "toy.1.et"]
    assert json.loads((out / "comm_groups.json").read_text()) == {"10": [0, 1]}  # ids of one width (groups.py)
    for rank in range(2):
        header, nodes = read_et(out / f"toy.{rank}.et")
        meta = attrs(header)
        assert meta["rank"].int64_val == rank and meta["model"].string_val == "toy"
        assert len(meta["notes"].string_list.values) == 2  # broadcast and barrier were rewritten
        assert [n.id for n in nodes] == list(range(6))
        assert [n.type for n in nodes] == [et.COMP_NODE, et.COMM_COLL_NODE, et.COMP_NODE] + [et.COMM_COLL_NODE] * 3
    assert summary["nodes"] == 12 and summary["ranks"] == 2 and summary["distinct_traces"] == 2
    assert validate_traces(out) == []


def test_nodes_carry_what_astra_sim_reads(tp_traces):
    out, _ = tp_traces
    _, nodes = read_et(out / "toy.0.et")
    mm, ar, gelu, ag, bcast, barrier = nodes
    assert attrs(mm)["num_ops"].int64_val == 512 and attrs(mm)["tensor_size"].uint64_val == 512
    assert attrs(mm)["is_cpu_op"].WhichOneof("value") == "bool_val" and not attrs(mm)["is_cpu_op"].bool_val
    assert mm.inputs.shapes == "[[4,8],[8,8]]" and json.loads(mm.inputs.types) == [F32, F32]
    # the view is folded: the all-reduce depends on the mm through it
    assert list(ar.data_deps) == [0] and list(gelu.data_deps) == [1]
    assert attrs(ar)["comm_type"].int64_val == et.ALL_REDUCE and attrs(ar)["comm_size"].int64_val == 128
    assert attrs(ar)["pg_name"].string_val == "10"
    # all-gather: the graph counts the gathered buffer, ASTRA-sim each rank's part
    assert attrs(ag)["comm_type"].int64_val == et.ALL_GATHER and attrs(ag)["comm_size"].int64_val == 128
    assert attrs(bcast)["comm_type"].int64_val == et.ALL_GATHER and attrs(bcast)["comm_size"].int64_val == 4
    assert attrs(barrier)["comm_type"].int64_val == et.ALL_REDUCE and attrs(barrier)["comm_size"].int64_val == 4
    # program order: each communication waits for the rank's previous one
    assert [list(n.ctrl_deps) for n in nodes] == [[], [], [], [1], [3], [4]]


def test_send_recv_pair(tmp_path):
    write_chakra({r: pp_rank(r) for r in range(2)}, tmp_path)
    (_, (relu, send)), (_, (recv, relu1)) = read_et(tmp_path / "pipe.0.et"), read_et(tmp_path / "pipe.1.et")
    assert send.type == et.COMM_SEND_NODE and list(send.data_deps) == [relu.id] and not send.ctrl_deps
    # peers and tags as int32_val: mlcommons' feeder reads them with int32_val()
    assert {k: getattr(a, a.WhichOneof("value")) for k, a in attrs(send).items() if k.startswith("comm")} == \
        {"comm_dst": 1, "comm_tag": 7, "comm_size": 128}
    assert {k: a.WhichOneof("value") for k, a in attrs(send).items() if k.startswith("comm")} == \
        {"comm_dst": "int32_val", "comm_tag": "int32_val", "comm_size": "int64_val"}
    assert recv.type == et.COMM_RECV_NODE and attrs(recv)["comm_src"].int64_val == 0
    assert list(relu1.data_deps) == [recv.id]
    assert validate_traces(tmp_path) == []


def test_chakra_jsonizer_reads_our_file_and_matches_the_json_form(tp_traces, tmp_path, monkeypatch):
    out, _ = tp_traces
    dumped = tmp_path / "jsonized.txt"
    monkeypatch.setattr(sys, "argv", ["chakra_jsonizer", "--input_filename", str(out / "toy.0.et"),
                                      "--output_filename", str(dumped)])
    jsonizer.main()
    text, objects, pos = dumped.read_text(), [], 0  # back-to-back JSON objects
    while pos < len(text):
        obj, pos = json.JSONDecoder().raw_decode(text, pos)
        objects.append(obj)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    ours = json.loads((out / "tensor_trace_chakra.json").read_text())
    assert [ours["global_metadata"], *ours["nodes"]] == objects
    assert len(objects) == 7


def test_json_form_equals_protobuf_json_format():
    graph = tp_rank(0)
    fill_durations(graph, load_hw_config("a100-80gb"))
    groups = graph_group_ids([graph])
    for spec in chakra_nodes(graph, groups):
        assert to_json(spec) == MessageToDict(to_proto(spec))


def test_durations_from_hw_config(tmp_path):
    graph = tp_rank(0, world=1)
    for _, d in graph.ops():  # big enough to take microseconds on an A100
        d["flops"] *= 10**8
    fill_durations(graph, load_hw_config("a100-80gb"))
    write_chakra({0: graph}, tmp_path)
    header, nodes = read_et(tmp_path / "toy.0.et")
    # a [4, 8] output from K = 512e8 / (2 * 4 * 8): one 16 x 128 tile at float32's 19.5 TFLOP/s, split over
    # every SM along K, then the FP32 partial sums written and read back
    a100 = load_hw_config("a100-80gb")
    tile_us = 2 * 16 * 128 * (512e8 / 64) / (19.5e12 * a100.gemm_efficiency) * 1e6
    reduction_us = 2 * a100.sm_count * 4 * 8 * 4 / (a100.memory_bw_gb_s * 1e3 * a100.memory_efficiency)
    assert nodes[0].duration_micros == round(a100.kernel_overhead_us + tile_us + reduction_us)
    assert attrs(header)["durations"].string_val == "from hw_config"


def test_identical_ranks_are_encoded_once(tmp_path):
    ranks = RankTraces(4)
    ranks.put_shared(range(4), lambda: tp_rank(0, world=4))
    summary = write_chakra(ranks, tmp_path)
    assert summary["distinct_traces"] == 1 and summary["ranks"] == 4
    bodies = [read_et(tmp_path / f"toy.{r}.et") for r in range(4)]
    assert all(nodes == bodies[0][1] for _, nodes in bodies)
    assert [attrs(h)["rank"].int64_val for h, _ in bodies] == [0, 1, 2, 3]
    assert validate_traces(tmp_path) == []


def test_refuses_a_folder_with_other_traces_unless_forced(tmp_path):
    write_chakra({r: tp_rank(r, world=3) for r in range(3)}, tmp_path)
    with pytest.raises(UserError, match="holds the outputs of an earlier syntorch run; pass --force"):
        write_chakra({r: tp_rank(r) for r in range(2)}, tmp_path)
    assert (tmp_path / "toy.2.et").exists()  # nothing touched
    write_chakra({r: tp_rank(r) for r in range(2)}, tmp_path, force=True)
    assert sorted(p.name for p in tmp_path.glob("*.et")) == ["toy.0.et", "toy.1.et"]  # rank 2 was stale
    assert validate_traces(tmp_path) == []


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(UserError, match="one graph per rank 0..N-1"):
        write_chakra({1: tp_rank(1)}, tmp_path)
    with pytest.raises(UserError, match="level op or module"):
        write_chakra({0: tp_rank(0, world=1)}, tmp_path, level="layer")
    assert not list(tmp_path.iterdir())


# --- end to end: the tracer's graphs of a tiny TP model ------------------------------------------------

@functools.cache  # traced once for the tests below, which only read it
def symbolic_tp_traces(tp: int = 2):
    from conftest import tiny_config
    from syntorch.trace.generation import trace_tp_symbolic

    return trace_tp_symbolic(tiny_config("gpt2"), torch.zeros(1, 5, dtype=torch.long), 2, tp)


@pytest.mark.parametrize("level", ["op", "module"])
def test_traced_tp_model(tmp_path, monkeypatch, level):
    from syntorch.trace import levels

    views = []
    monkeypatch.setattr(levels, "level_view", lambda g, lv, view=levels.level_view: views.append(lv) or view(g, lv))
    ranks = symbolic_tp_traces()
    graph = ranks[0]
    summary = write_chakra(ranks, tmp_path, level=level)
    assert summary["distinct_traces"] == 1 and validate_traces(tmp_path) == []
    assert views == ([] if level == "op" else ["module"])  # both ranks share one graph: collapsed once
    _, nodes = read_et(tmp_path / "tiny-gpt2.1.et")
    colls = [n for n in nodes if n.type == et.COMM_COLL_NODE]
    assert len(colls) == sum(1 for _ in graph.collectives())  # every collective kept, at every level
    comps = [n for n in nodes if n.type == et.COMP_NODE]
    num_ops = sum(attrs(n)["num_ops"].int64_val for n in comps)  # 0-FLOP nodes say 1 (ASTRA-sim's roofline)
    assert graph.total_flops() < num_ops <= graph.total_flops() + len(comps)
    assert all(attrs(n)["tensor_size"].uint64_val > 0 for n in comps)
    assert validate_traces(tmp_path, roofline=True) == []
    if level == "op":
        kept = [d for _, d in graph.ops() if not (d["is_view"] or d["bytes_read"] + d["bytes_written"] == 0)]
        assert len(comps) == len(kept)
        assert num_ops == sum(max(d["flops"], 1) for d in kept)


def traced_forward(rank: int, world: int, device: str):
    """One TP rank's traced forward of the tiny model; real collectives on cpu (gloo), symbolic on meta.
    (A forward, not a generation: on meta generate() skips token sampling, which has no values to read.)"""
    from conftest import tiny_config
    from syntorch.models import build_model
    from syntorch.parallel.mesh import Mesh, init_groups
    from syntorch.parallel.tensor import apply_tp
    from syntorch.trace.tracer import Tracer

    torch.manual_seed(0)
    model = build_model(tiny_config("gpt2"), device=device, dtype=torch.float32)
    apply_tp(model, init_groups(Mesh(tp=world)), False)
    tracing = Tracer(model, rank=rank, world_size=world, meta={"model": "tiny-gpt2", "tp": world})
    with torch.inference_mode(), tracing as tracer:  # as generate() runs the model
        model(torch.zeros(1, 5, dtype=torch.long, device=device))
    return tracer.graph


def real_tp_rank(out_dir: str) -> None:
    from syntorch.export.networkx_json import export
    from syntorch.parallel.launch import init_distributed

    rank, world = init_distributed("cpu")
    export(traced_forward(rank, world, "cpu"), f"{out_dir}/rank{rank}.json")


def comparable(path):
    """A trace without what differs between a real and a symbolic run: durations and tensor ids."""
    _, nodes = read_et(path)
    for node in nodes:
        node.duration_micros = 0
        node.inputs.values = node.outputs.values = ""
    return nodes


def test_real_and_symbolic_traces_agree(tmp_path):
    from syntorch.export.networkx_json import load
    from syntorch.parallel.distributed import symbolic_world
    from syntorch.parallel.launch import spawn

    spawn(real_tp_rank, 2, (str(tmp_path),))
    real = {r: load(tmp_path / f"rank{r}.json") for r in range(2)}
    with symbolic_world(0, 2):  # TP ranks are symmetric: rank 0 stands for both, as trace_tp_symbolic does
        shared = traced_forward(0, 2, "meta")
    symbolic = RankTraces(2)
    symbolic.put_shared(range(2), lambda: shared)
    write_chakra(real, tmp_path / "real")
    write_chakra(symbolic, tmp_path / "symbolic")
    assert validate_traces(tmp_path / "real") == [] and validate_traces(tmp_path / "symbolic") == []
    for rank in range(2):
        a, b = comparable(tmp_path / f"real/tiny-gpt2.{rank}.et"), comparable(tmp_path / f"symbolic/tiny-gpt2.{rank}.et")
        assert sum(n.type == et.COMM_COLL_NODE for n in a) == 6  # embedding, 2 per layer, the head's all-gather
        assert a == b


def test_export_command_from_a_saved_graph(tmp_path, capsys):
    from syntorch.cli import main
    from syntorch.export.networkx_json import export as save_json

    graph = symbolic_tp_traces()[0]
    save_json(graph, tmp_path / "tensor_trace_graph.json")
    argv = ["export", "--input", str(tmp_path / "tensor_trace_graph.json"), "--format", "chakra", "--output"]
    assert main([*argv, str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").glob("*.et")) == ["tiny-gpt2.0.et", "tiny-gpt2.1.et"]
    assert validate_traces(tmp_path / "out") == []
    assert main([*argv, str(tmp_path / "out")]) == 2  # traces there already
    assert "pass --force" in capsys.readouterr().err
    assert main([*argv, str(tmp_path / "seed" / "model.json")]) == 0  # seed 000: --output model.json
    assert sorted(p.name for p in (tmp_path / "seed").iterdir()) == [
        ".syntorch.json", "comm_groups.json", "model.json", "tiny-gpt2.0.et", "tiny-gpt2.1.et"]
    assert json.loads((tmp_path / "seed" / "model.json").read_text())["nodes"]


def test_shared_ranks_get_durations_once(monkeypatch):
    from syntorch.trace import cost

    ranks = RankTraces(4)
    ranks.put_shared(range(4), lambda: tp_rank(0, world=4))
    filled = []
    fill_durations = cost.fill_durations
    monkeypatch.setattr(cost, "fill_durations", lambda graph, hw, *profile: filled.append(graph) or
                        fill_durations(graph, hw, *profile))
    cost.fill_rank_durations(ranks, load_hw_config("h100-sxm"))
    assert len(filled) == 1  # the four ranks share one graph: costed once
    assert all(d["duration_us"] > 0 for _, d in ranks[3].nodes(data=True) if d["kind"] == "collective")
