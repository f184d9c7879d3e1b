"""Real capture: 2-rank DDP trainings of tiny GPT-2 (`syntorch train --nproc 2`) and BERT (`torchrun -m
syntorch.train`) under the profiler, linked and converted with mlc-chakra, checked with the official
protolib and converter, the model's gradient bytes and the ASTRA-sim validator. The runs are slow
(profiler + linker), so one module-scoped fixture makes them and every test reads its files."""
import json
import subprocess
import sys

import networkx as nx
import pytest
from chakra.schema.protobuf import et_def_pb2 as et
from chakra.src.third_party.utils.protolib import decodeMessage, openFileRd

from syntorch.capture.to_chakra import official_tools
from syntorch.capture.repair import drop_forward_inter_thread_deps
from syntorch.capture.traces import repair_host_trace
from syntorch.cli import main
from syntorch.errors import UserError
from syntorch.chakra.validator import validate_traces
from conftest import tiny_config
from train_data import make_model, make_squad, make_tokenizer

RANKS = 2
CAPTURE = ["--batch-size", "2", "--max-seq-length", "32", "--max-steps", "3", "--bucket-cap-mb", "0.1",
           "--enable-tracing", "--trace-wait-steps", "1", "--trace-warmup-steps", "1", "--trace-active-steps", "1"]


def train_command(ws, family, out):
    return [family, "--data", str(ws / "squad.json"), "--model-name", str(ws / family), "--tokenizer", str(ws / "tok"),
            "--device", "cpu", "--save-dir", str(ws / f"ckpt_{family}"), "--trace-output-dir", str(out),
            "--trace-name", family, *CAPTURE]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ws = tmp_path_factory.mktemp("capture")
    make_squad(ws / "squad.json", articles=3)
    make_tokenizer(ws / "tok")
    for family, base in (("gpt2", "gpt2"), ("bert", "bert-base-uncased")):
        make_model(ws / family, base)
    out = ws / "outputs"  # one folder per run: a folder holds one run's outputs
    (out / "gpt2").mkdir(parents=True)
    stale = ["gpt2.2.et", "gpt2_host.3.json"]  # left by an earlier 4-rank run with the same name
    for name in stale:
        (out / "gpt2" / name).write_text("old")
    (out / "gpt2" / ".syntorch.json").write_text(json.dumps({"files": stale}))
    gpt2 = ["train", *train_command(ws, "gpt2", out / "gpt2"), "--nproc", str(RANKS)]
    assert main(gpt2) == 2  # refused before any rank starts: it holds an earlier run's traces
    assert main([*gpt2, "--force"]) == 0
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
                "-m", "syntorch.train", *train_command(ws, "bert", out / "bert")]
    done = subprocess.run(torchrun, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not [line for line in done.stderr.splitlines() if line.startswith(("USDT:", "STAGE:"))]  # no Kineto chatter
    return out


def read_et(path):
    """(GlobalMetadata, nodes) with mlc-chakra's own protolib."""
    f = openFileRd(str(path))
    header = et.GlobalMetadata()
    assert decodeMessage(f, header)
    nodes = []
    while True:
        node = et.Node()
        if not decodeMessage(f, node):
            return header, nodes
        nodes.append(node)


def attrs(node):
    return {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr}


def grad_bytes(base):
    from syntorch.models import build_model
    return sum(p.numel() * p.element_size() for p in build_model(tiny_config(base)).parameters())


def dependency_graph(nodes):
    g = nx.DiGraph()
    g.add_nodes_from(n.id for n in nodes)
    g.add_edges_from((d, n.id) for n in nodes for d in (*n.data_deps, *n.ctrl_deps))
    return g


FAMILIES = pytest.mark.parametrize("family, base", [("gpt2", "gpt2"), ("bert", "bert-base-uncased")])


@FAMILIES
def test_every_rank_leaves_host_device_stacks_linked_and_et(runs, family, base):
    folder = runs / family
    for rank in range(RANKS):
        for name in (f"{family}_host.{rank}.json", f"{family}_device.{rank}.json", f"{family}_merged.{rank}.json",
                     f"{family}_stacks.{rank}.txt", f"{family}.{rank}.et"):
            assert (folder / name).stat().st_size > 0, name
        assert "ProfilerStep#2" in (folder / f"{family}_host.{rank}.json").read_text()  # the active step, on both traces
        assert "ProfilerStep#2" in (folder / f"{family}_device.{rank}.json").read_text()
    assert not (runs / "gpt2" / "gpt2.2.et").exists() and not (runs / "gpt2" / "gpt2_host.3.json").exists()
    # the plan's mesh groups of two DP ranks (the DP group and the gradient norm's world, and each rank's own TP
    # group), beside the default group "0"
    groups = {tuple(members) for members in json.loads((folder / "comm_groups.json").read_text()).values()}
    assert (0, 1) in groups and groups <= {(0,), (1,), (0, 1)}, groups
    assert not [*runs.glob(".syntorch-tmp.*"), *folder.glob(".syntorch-tmp.*")]  # no temporary folders left


@FAMILIES
def test_traces_have_forward_backward_and_optimizer_compute(runs, family, base):
    for rank in range(RANKS):
        header, nodes = read_et(runs / family / f"{family}.{rank}.et")
        assert {a.name for a in header.attr} >= {"schema", "pid"}
        compute = [n.name for n in nodes if n.type == et.COMP_NODE]
        assert {"forward", "backward", "optimizer"} <= set(compute) and "aten::addmm" in compute  # the plan's phases
        assert any(name.endswith("Backward0") for name in compute) and "aten::mm" in compute
        assert any(name.startswith("Optimizer.step#AdamW") for name in compute) and "aten::addcdiv_" in compute
        assert not [n for n in nodes if n.type == et.METADATA_NODE]


@FAMILIES
def test_gradient_all_reduces_are_collectives_of_the_models_gradient_bytes(runs, family, base):
    sizes, groups = {}, json.loads((runs / family / "comm_groups.json").read_text())
    for rank in range(RANKS):
        _, nodes = read_et(runs / family / f"{family}.{rank}.et")
        colls = [attrs(n) for n in nodes if n.type == et.COMM_COLL_NODE and attrs(n)["comm_type"] == et.ALL_REDUCE]
        assert len(colls) >= 2  # several DDP buckets at --bucket-cap-mb 0.1
        # over the DP group the flight recorder logged
        assert all(c["is_cpu_op"] is False and groups.get(c["pg_name"]) == [0, 1] for c in colls)
        sizes[rank] = [c["comm_size"] for c in colls]
        # one active step: every gradient once; DDP pads nothing on CPU, so the sum is exact
        assert grad_bytes(base) <= sum(sizes[rank]) <= grad_bytes(base) + 64 * len(colls)
    assert sizes[0] == sizes[1]


@FAMILIES
def test_backward_overlaps_the_all_reduce_and_the_optimizer_waits_for_it(runs, family, base):
    _, nodes = read_et(runs / family / f"{family}.0.et")
    graph, by_id = dependency_graph(nodes), {n.id: n for n in nodes}
    colls = [n.id for n in nodes if n.type == et.COMM_COLL_NODE and attrs(n)["comm_type"] == et.ALL_REDUCE]
    first = colls[0]
    after = nx.descendants(graph, first)
    overlapping = [i for i in by_id if i > first and i not in after and by_id[i].name.endswith("Backward0")]
    assert overlapping  # backward after the first bucket's launch does not wait for its all-reduce
    step = next(n.id for n in nodes if n.name.startswith("Optimizer.step#AdamW"))
    assert set(colls) <= nx.ancestors(graph, step)


@FAMILIES
def test_astra_sim_validator_accepts_the_traces(runs, family, base):
    assert validate_traces(runs / family / family) == []


def test_the_official_converter_alone_leaves_gloo_all_reduce_a_compute_node(runs, tmp_path):
    # the fact our repair exists for (mlc-chakra 1.0.0): if this fails, a newer converter does it itself
    _, converter = official_tools()
    converter().convert(str(runs / "gpt2" / "gpt2_merged.0.json"), str(tmp_path / "official.et"), False)
    _, nodes = read_et(tmp_path / "official.et")
    gloo = [n for n in nodes if n.name == "gloo:all_reduce"]
    assert gloo and all(n.type == et.COMP_NODE for n in gloo)
    assert not [n for n in nodes if n.type == et.COMM_COLL_NODE]
    assert [n for n in nodes if n.type == et.METADATA_NODE]


def test_forward_inter_thread_dependency_is_dropped_before_the_converter_sees_a_cycle(runs, tmp_path):
    # seen in a real run: the linker made gloo:all_reduce depend on a later main-thread op, and
    # chakra_converter stopped with "Cyclic dependency detected"
    linked = json.loads((runs / "gpt2" / "gpt2_merged.0.json").read_text())
    gloo = next(n for n in linked["nodes"] if n["name"] == "gloo:all_reduce")
    later = next(n for n in linked["nodes"] if n["name"].startswith("Optimizer.step#AdamW"))
    gloo["inter_thread_dep"] = later["id"]
    _, converter = official_tools()
    path = tmp_path / "linked.json"
    path.write_text(json.dumps(linked))
    with pytest.raises(Exception, match="Cyclic dependency"):
        converter().convert(str(path), str(tmp_path / "cycle.et"), False)
    assert drop_forward_inter_thread_deps(linked["nodes"]) == 1 and gloo["inter_thread_dep"] is None
    path.write_text(json.dumps(linked))
    converter().convert(str(path), str(tmp_path / "ok.et"), False)
    assert len(read_et(tmp_path / "ok.et")[1]) > 1000


def test_convert_repairs_a_host_trace_written_twice(runs, tmp_path, capsys, monkeypatch):
    text = (runs / "gpt2" / "gpt2_host.1.json").read_text()
    (tmp_path / "host.json").write_text(text + "\n" + text)
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "device.json").write_text((runs / "gpt2" / "gpt2_device.1.json").read_text())
    monkeypatch.chdir(tmp_path)  # relative paths: the linker alone would double the device trace's folder
    code = main(["convert", "--host", "host.json", "--device", "traces/device.json", "--rank", "1",
                 "--output", "g.1.et"])
    assert code == 0 and "kept the largest of 2 JSON documents" in capsys.readouterr().out
    _, ours = read_et(tmp_path / "g.1.et")
    _, theirs = read_et(runs / "gpt2" / "gpt2.1.et")
    assert [(n.name, n.type, list(n.data_deps)) for n in ours] == [(n.name, n.type, list(n.data_deps)) for n in theirs]


def test_repair_drops_duplicated_node_ids():
    node = {"id": 5, "name": "aten::mm", "ctrl_deps": 1, "inputs": {}, "outputs": {}}
    trace = json.dumps({"schema": "1.1.1-chakra.0.0.4", "pid": 1, "nodes": [node, {**node, "name": "dup"}]})
    fixed, repairs = repair_host_trace(trace)
    assert [n["name"] for n in fixed["nodes"]] == ["aten::mm"] and repairs == ["dropped 1 nodes with duplicated ids"]
    with pytest.raises(UserError, match="not a PyTorch host execution trace"):
        repair_host_trace('{"traceEvents": []}')


@pytest.mark.parametrize("host, device, rank, message", [
    ("cut", "gpt2_device.0.json", 0, "is not valid JSON"),
    ("gpt2_host.0.json", "notjson", 0, "is not valid JSON"),
    ("gpt2_host.0.json", "noevents", 0, "not a Kineto trace"),
    ("gpt2_host.0.json", "gpt2_device.0.json", 1, "is from rank 0, not rank 1"),
    ("gpt2_host.0.json", "gpt2_device.1.json", 1, "give the two traces of the same rank"),
    ("missing", "gpt2_device.0.json", 0, "host trace not found"),
])
def test_convert_bad_input_is_one_line_exit_2_and_writes_nothing(runs, tmp_path, capsys, host, device, rank, message):
    made = {"cut": (runs / "gpt2" / "gpt2_host.0.json").read_text()[:50000], "notjson": "{", "noevents": '{"x": 1}'}
    for name, text in made.items():
        (tmp_path / name).write_text(text)

    def where(name):
        return tmp_path / name if name in made or name == "missing" else runs / "gpt2" / name

    out = tmp_path / "out" / f"x.{rank}.et"
    code = main(["convert", "--host", str(where(host)), "--device", str(where(device)), "--rank", str(rank),
                 "--output", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_tracing_without_the_capture_extra_says_what_to_install(tmp_path, monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hta" else find_spec(name, *a))
    argv = ["train", "gpt2", "--data", str(tmp_path / "squad.json"), "--device", "cpu", "--enable-tracing",
            "--trace-output-dir", str(tmp_path / "t")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "pip install -e '.[capture]'" in err, err
    assert not (tmp_path / "t").exists()
