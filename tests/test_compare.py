"""Captured equals traced: `syntorch train --enable-tracing` of a plan on gloo ranks, captured with the profiler
and converted with mlc-chakra, communicates as `syntorch trace` of the same plan says, rank by rank
(`syntorch compare`): DP2 x TP2 and DP2 x CP2 on GPT-2, TP2 x PP2 (1F1B, 4 micro-batches) on a tiny Llama,
EP2 on a tiny Mixtral (Llama with MoE layers). Both sides run fp32, the same micro-batches and sequence length.

Captures are slow (spawned ranks, profiler, linker, converter), so one module-scoped fixture makes the four,
with one profiled step each, and every test reads them. An altered trace (a changed size, a dropped
collective, a wrong peer) is reported as a difference; bad input is one line and exit 2."""
import json
import shutil

import pytest
from chakra.schema.protobuf import et_def_pb2 as et
from chakra.src.third_party.utils.protolib import encodeMessage

from conftest import tiny_config
from syntorch.chakra.reader import read_trace
from syntorch.cli import main
from syntorch.config import save_model_config
from train_data import make_squad, make_tokenizer

SEQ, MICRO = 16, 2  # tokens per sequence (every item is longer: no padding decides a length), rows per micro-batch
# name -> (model, ranks, plan flags both commands take, train-only flags, trace-only flags)
LAYOUTS = {
    "dp2-tp2": ("gpt2", 4, ["--tp", "2"], [], ["--dp", "2"]),
    "tp2-pp2": ("llama", 4, ["--tp", "2", "--pp", "2", "--microbatches", "4"], [], []),
    "dp2-cp2": ("gpt2", 4, ["--cp", "2"], [], ["--dp", "2"]),
    "ep2": ("mixtral", 2, ["--ep", "2"], [], ["--dp", "2"]),
}
# name -> (registry name, its tiny config); HuggingFace's Llama has no partial rotary: full rotary saves
MODELS = {"gpt2": ("gpt2", tiny_config("gpt2")),
          "llama": ("llama-3-8b", tiny_config("llama-3-8b", n_kv_head=2, rotary_dim=0)),
          "mixtral": ("mixtral-8x7b", tiny_config("mixtral-8x7b", n_kv_head=2, n_experts=4, rotary_dim=0))}
# wait 0, warm up 1 (the profiler's first step after start is not recorded whole), record 1
PROFILE = ["--max-steps", "2", "--enable-tracing", "--trace-wait-steps", "0", "--trace-warmup-steps", "1",
           "--trace-active-steps", "1"]


def microbatches(plan: list[str]) -> int:
    return int(dict(zip(plan[::2], plan[1::2])).get("--microbatches", 1))


def capture(ws, name: str) -> None:
    model, ranks, plan, train_only, _ = LAYOUTS[name]
    code = main(["train", "gpt2", "--data", str(ws / "squad.json"), "--tokenizer", str(ws / "tok"),
                 "--model-name", MODELS[model][0], "--model_config", str(ws / f"{model}.json"), "--device", "cpu",
                 "--nproc", str(ranks), "--batch-size", str(MICRO * microbatches(plan)), "--max-seq-length", str(SEQ),
                 "--num-epochs", "1", "--eval-fraction", "0", "--dtype", "fp32", "--save-dir", str(ws / f"ckpt-{name}"),
                 "--trace-output-dir", str(ws / "real" / name), "--trace-name", model, *PROFILE, *plan, *train_only])
    assert code == 0


def trace(ws, name: str) -> None:
    model, _, plan, _, trace_only = LAYOUTS[name]
    code = main(["trace", "--model", MODELS[model][0], "--model_config", str(ws / f"{model}.json"), "--dtype", "fp32",
                 "--micro_batch_size", str(MICRO), "--seq", str(SEQ), "--out", str(ws / "traced" / name),
                 "--no_progress", *plan, *trace_only])
    assert code == 0


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    make_squad(root / "squad.json", articles=3)
    make_tokenizer(root / "tok")
    for name, (_, config) in MODELS.items():
        save_model_config(config, root / f"{name}.json")
    for name in LAYOUTS:
        capture(root, name)
        trace(root, name)
    return root


def compare(capsys, real, traced) -> tuple[int, list[str]]:
    code = main(["compare", str(real), str(traced)])
    return code, capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_captured_run_communicates_as_its_symbolic_trace(ws, capsys, name):
    code, out = compare(capsys, ws / "real" / name, ws / "traced" / name)
    print("\n".join(out))
    assert code == 0, "\n".join(out[:20])
    assert out[-1].startswith(f"equal: {LAYOUTS[name][1]} ranks, ")


def test_pipeline_sends_and_recvs_are_paired_with_global_peers(ws, capsys):
    # 1F1B over 2 stages: each rank sends and receives one activation (or gradient) part per micro-batch each way
    code, out = compare(capsys, ws / "real" / "tp2-pp2", ws / "traced" / "tp2-pp2")
    assert code == 0 and out[-1].endswith(f", {4 * 2 * 4} send/recvs"), out[-1]


def rewrite(path, change) -> None:
    """`path` with `change(nodes)` applied to its nodes."""
    header, nodes = read_trace(path)
    nodes = change(nodes)
    with open(path, "wb") as f:
        encodeMessage(f, header)
        for node in nodes:
            encodeMessage(f, node)


def comms(nodes, node_type=et.COMM_COLL_NODE):
    return [n for n in nodes if n.type == node_type]


def set_attr(node, name, value):
    next(a for a in node.attr if a.name == name).int64_val = value


@pytest.fixture
def altered(ws, tmp_path):
    """A copy of the DP2 x TP2 capture to alter."""
    return shutil.copytree(ws / "real" / "dp2-tp2", tmp_path / "real")


def test_a_changed_size_is_one_line(ws, capsys, altered):
    def grow_third(nodes):
        set_attr(comms(nodes)[2], "comm_size", 12345)
        return nodes

    rewrite(altered / "gpt2.1.et", grow_third)
    code, out = compare(capsys, altered, ws / "traced" / "dp2-tp2")
    assert code == 1 and len(out) == 2 and out[0].startswith("rank 1 #2: "), out
    assert "bytes 12345 in real, 8192 in traced" in out[0] and out[1] == "1 difference", out


def test_a_dropped_collective_is_reported_where_it_went_missing(ws, capsys, altered):
    def drop_last(nodes):
        last = comms(nodes)[-1].id
        return [n for n in nodes if n.id != last]

    rewrite(altered / "gpt2.3.et", drop_last)
    code, out = compare(capsys, altered, ws / "traced" / "dp2-tp2")
    assert code == 1 and len(out) == 2 and out[0].startswith("rank 3 #") and "only in traced" in out[0], out


def test_a_wrong_peer_and_a_wrong_group_are_differences(ws, capsys, tmp_path):
    real = shutil.copytree(ws / "real" / "tp2-pp2", tmp_path / "real")

    def send_to_self(nodes):
        next(a for a in comms(nodes, et.COMM_SEND_NODE)[0].attr if a.name == "comm_dst").int32_val = 0
        return nodes

    rewrite(real / "llama.0.et", send_to_self)
    groups = json.loads((real / "comm_groups.json").read_text())
    tp = next(k for k, v in groups.items() if v == [2, 3])
    groups[tp] = [0, 2, 3]  # rank 2's and 3's TP collectives now name a group of three
    (real / "comm_groups.json").write_text(json.dumps(groups))
    code, out = compare(capsys, real, ws / "traced" / "tp2-pp2")
    assert code == 1
    assert [line for line in out if line.startswith("rank 0 ")] == [out[0]] and "peer 0 in real, 2 in traced" in out[0]
    assert any(line.startswith("rank 2 ") and "group [0, 2, 3] in real, [2, 3] in traced" in line for line in out)


def test_moe_all_to_all_bytes_are_compared_over_the_group(ws, capsys, tmp_path):
    real = shutil.copytree(ws / "real" / "ep2", tmp_path / "real")

    def grow_first_all_to_all(nodes):
        node = next(n for n in comms(nodes) if next(a.int64_val for a in n.attr if a.name == "comm_type") == et.ALL_TO_ALL)
        set_attr(node, "comm_size", next(a.int64_val for a in node.attr if a.name == "comm_size") + 8)
        return nodes

    rewrite(real / "mixtral.0.et", grow_first_all_to_all)
    code, out = compare(capsys, real, ws / "traced" / "ep2")
    assert code == 1 and out[0].startswith("group [0, 1] all_to_all #0: ") and len(out) == 2, out


@pytest.mark.parametrize("problem", ["missing", "unknown group"])
def test_bad_input_is_one_line_and_exit_2(ws, capsys, tmp_path, problem):
    real = tmp_path / "nothing"
    if problem == "unknown group":
        real = shutil.copytree(ws / "real" / "dp2-tp2", tmp_path / "real")
        (real / "comm_groups.json").write_text("{}")
    code = main(["compare", str(real), str(ws / "traced" / "dp2-tp2")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("syntorch compare: error: "), err


def test_a_peer_is_the_candidate_that_posted_the_matching_op():
    from syntorch.capture.peers import PointToPoint, find_peers

    # rank 0 is in a TP pair [0, 1] and a pipeline link [0, 2]: group rank 1 of either could be its peer
    groups = {0: {"1": [0, 1], "7": [0, 2]}, 1: {"1": [0, 1]}, 2: {"7": [0, 2]}}
    ops = {0: [PointToPoint("send", 1, 0, 64), PointToPoint("send", 1, 1, 64)],
           1: [PointToPoint("recv", 0, 1, 64)], 2: [PointToPoint("recv", 0, 0, 64)]}
    found = find_peers(ops, groups)
    assert found[0] == [(2, "7"), (1, "1")] and found[2] == [(0, "7")] and found[1] == [(0, "1")]
    ops[1].append(PointToPoint("recv", 0, 0, 64))  # now both candidates hold a matching recv: not guessed
    assert find_peers(ops, groups)[0][0] is None
