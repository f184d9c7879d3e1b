"""CommDebugMode: counts cross-checked against torch's own CommDebugMode, noise levels, syntorch's extra
details, and real gloo ranks."""
import copy
import json
import re

import pytest
import torch

from conftest import tiny_config
from syntorch import CommDebugMode
from syntorch.cli import main
from syntorch.errors import UserError
from syntorch.export.comm_report import write_comm_outputs
from syntorch.models import build_model
from syntorch.parallel import distributed as comm
from syntorch.parallel.launch import spawn
from syntorch.parallel.tensor import apply_tp

# torch keys its counts by op; syntorch by collective kind
TORCH_KINDS = {"c10d_functional.all_reduce": "all_reduce", "c10d.allreduce_": "all_reduce",
               "c10d_functional.all_gather_into_tensor": "all_gather", "c10d._allgather_base_": "all_gather",
               "c10d_functional.reduce_scatter_tensor": "reduce_scatter",
               "c10d._reduce_scatter_base_": "reduce_scatter"}
B, T = 2, 8


def torch_comm_debug_mode():
    # imported here: torch.distributed.tensor.debug pulls in inductor (~3 s), which spawned ranks should not pay
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode
    return TorchCommDebugMode()


def torch_module_counts(mode, root: str) -> dict:
    """{(module, section, kind): count}; torch names modules "<RootClass>.<fqn>" under "Global"; the root's own
    row is Global's (everything here runs inside the model)."""
    out = {}
    for fqn, sections in mode.comm_module_counts.items():
        if fqn == root:
            continue
        name = fqn.removeprefix(root + ".")
        for section, counts in sections.items():
            out.update({(name, section, TORCH_KINDS[str(op)]): n for op, n in counts.items() if n})
    return out


def syntorch_module_counts(mode: CommDebugMode) -> dict:
    return {(name, section, kind): n for name, sections in mode.get_comm_module_counts().items()
            for section, counts in sections.items() for kind, n in counts.items()}


def table_modules(table: str, root: str = "") -> list[str]:
    """Module names in the order a noise-level-0 table lists them."""
    plain = re.sub(r"\x1B\[[0-?]*[ -/]*[@-~]", "", table)
    names = [line.strip() for line in plain.split("TOTALS PER PHASE")[0].splitlines()
             if line.strip() and not line.strip().startswith("*") and "PASS" not in line]
    return [n.removeprefix(root + ".") for n in names if n != root]


@pytest.fixture(scope="module")
def tp_mlp_run():
    """A tiny GPT's MLP sharded by syntorch's apply_tp at TP 2 (fake process group), forward + backward."""
    config = tiny_config("gpt2", n_layer=1)
    with comm.symbolic_world(0, 2):
        model = build_model(config)
        apply_tp(model)
        mlp = model.layers["0"].mlp
        mode = CommDebugMode(mlp)
        with mode:
            mlp(torch.randn(B, T, config.d_model, requires_grad=True)).sum().backward()
    return mode, config


@pytest.mark.parametrize("world, device", [(2, "cpu"), (4, "meta")])
def test_mlp_counts_agree_with_torch_dtensor(world, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    config = tiny_config("gpt2", n_layer=1)
    x = torch.randn(B, T, config.d_model, requires_grad=True, device=device)
    with comm.symbolic_world(0, world):
        model = build_model(config, device=device)
        reference = copy.deepcopy(model.layers["0"].mlp)
        parallelize_module(reference, init_device_mesh("cpu", (world,)),
                           {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        torch_mode = torch_comm_debug_mode()
        with torch_mode:
            reference(x).sum().backward()
        apply_tp(model)
        mode = CommDebugMode(model.layers["0"].mlp)
        with mode:
            model.layers["0"].mlp(x).sum().backward()
    expected = {("Global", "forward", "all_reduce"): 1, ("Global", "backward", "all_reduce"): 1,
                ("fc2", "forward", "all_reduce"): 1, ("fc1", "backward", "all_reduce"): 1}
    assert torch_module_counts(torch_mode, "MLP") == expected  # the reference says what DESIGN.md says
    assert syntorch_module_counts(mode) == expected
    assert mode.get_total_counts() == torch_mode.get_total_counts() == 2
    assert mode.get_comm_counts() == {"all_reduce": 2}


@pytest.mark.filterwarnings("ignore:Full backward hook")  # torch's module tracker, on token-id inputs
def test_whole_tp_model_agrees_with_torch_observer():
    """The same syntorch TP run (embedding, attention, MLP, LM head) seen by torch's CommDebugMode and ours:
    the same modules in the same order, with the same counts per module and section."""
    config = tiny_config("gpt2", n_layer=2)
    ids = torch.randint(0, config.vocab_size, (B, T))
    with comm.symbolic_world(1, 2):
        model = build_model(config)
        apply_tp(model)
        torch_mode = torch_comm_debug_mode()
        with torch_mode:
            model(ids).sum().backward()
        mode = CommDebugMode()  # no model given: found when it first runs, as torch finds it
        with mode:
            model(ids).sum().backward()
    counts = syntorch_module_counts(mode)
    assert counts == torch_module_counts(torch_mode, "GPT")
    assert counts[("layers.1.attn.proj", "forward", "all_reduce")] == 1
    assert counts[("lm_head", "forward", "all_gather")] == 1
    assert table_modules(mode.generate_comm_debug_tracing_table(0)) == \
        table_modules(torch_mode.generate_comm_debug_tracing_table(0), "GPT")


def test_noise_levels_add_what_the_tutorial_says(tp_mlp_run):
    mode, _ = tp_mlp_run
    ops = [set(re.findall(r"\*\*(\S+?)\x1b", mode.generate_comm_debug_tracing_table(n))) for n in range(4)]
    assert ops[0] == set()  # 0: module-level counts only
    assert {"c10d.allreduce_", "aten.addmm", "aten.mm"} <= ops[1]  # 1: collectives, ops reading parameters
    assert "aten.gelu" not in ops[1] and "aten.t" not in ops[1]
    assert "aten.gelu" in ops[2] and "aten.gelu_backward" in ops[2] and "aten.t" not in ops[2]  # 2: no trivial
    assert "aten.t" in ops[3] and ops[2] < ops[3]  # 3: everything
    level0, level1 = mode.generate_comm_debug_tracing_table(0), mode.generate_comm_debug_tracing_table(1)
    assert "*module type: syntorch.parallel.tensor.ColumnParallelLinear" in level1 and "*Parameter List" in level1
    assert "*module type" not in level0 and "*Parameter List" not in level0
    for bad in (4, -1, "1", None, True):
        with pytest.raises(UserError, match="noise level must be 0, 1, 2 or 3"):
            mode.generate_comm_debug_tracing_table(bad)


def test_collective_details_and_totals(tp_mlp_run):
    mode, config = tp_mlp_run
    forward, backward = mode.get_collectives()
    activation_bytes = B * T * config.d_model * 4  # Megatron's g and f move b*s*h fp32 values
    assert forward == {"node": forward["node"], "module": "fc2", "phase": "forward", "collective": "all_reduce",
                       "reduce_op": "sum", "bytes": activation_bytes, "group": [0, 1], "order": 0, "src": None,
                       "dst": None, "tag": 0}
    assert (backward["module"], backward["phase"], backward["order"]) == ("fc1", "backward", 1)
    assert mode.report.phase_totals == {"forward": {"all_reduce": [1, activation_bytes]},
                                        "backward": {"all_reduce": [1, activation_bytes]}}
    params = mode.get_parameter_info()
    assert params["fc1"]["weight"].shape == (config.d_ff // 2, config.d_model)  # this rank's shard
    assert params["fc2"]["bias"].shape == (config.d_model,)
    assert f"*all_reduce: 1 ({activation_bytes / 1024:.1f} KiB)" in mode.generate_comm_debug_tracing_table(0)


def test_files_follow_torch(tp_mlp_run, tmp_path):
    mode, _ = tp_mlp_run
    mode.log_comm_debug_tracing_table_to_file(file_name=tmp_path / "log.txt", noise_level=1)
    text = (tmp_path / "log.txt").read_text()
    assert "\x1b" not in text and text.startswith("Global\n") and "BACKWARD PASS" in text
    mode.generate_json_dump(file_name=tmp_path / "dump.json", noise_level=2)
    tree = json.loads((tmp_path / "dump.json").read_text())
    fc1 = next(c for c in tree["children"] if c["fqn"] == "fc1")
    assert fc1["collectives_backward"] == [["all_reduce", 1]] and fc1["collectives_forward"] == []
    assert any(op["name"] == "aten.addmm" for op in fc1["operations_forward"])
    assert {"fqn", "module_type", "parameters", "children", "operations_backward",
            "operations_checkpointing"} <= set(fc1)
    assert tree["phase_totals"]["backward"]["all_reduce"]["count"] == 1 and len(tree["collectives"]) == 2
    write_comm_outputs(mode.graph, tmp_path / "run", noise_level=1)  # what infer --comm_debug writes
    assert (tmp_path / "run" / "comm_debug_log.txt").read_text() == text
    assert json.loads((tmp_path / "run" / "comm_debug.json").read_text())["noise_level"] == 1
    assert (tmp_path / "run" / "comm_debug.html").read_text().startswith("<!DOCTYPE html>")


def _ranks_worker(out_dir):
    """Each real gloo rank: a TP MLP forward + backward, then p2p, broadcast and an averaging all-reduce."""
    import torch.distributed as dist
    from syntorch.parallel.launch import init_distributed
    rank, world = init_distributed("cpu")
    torch.manual_seed(0)
    config = tiny_config("gpt2", n_layer=1)
    model = build_model(config)
    apply_tp(model)
    mode = CommDebugMode(model)
    x = torch.randn(B, T, config.d_model, requires_grad=True)
    with mode:
        model.layers["0"].mlp(x).sum().backward()
        buf = torch.full((3,), float(rank + 1))  # stays 2.0 on rank 1 unless the recv arrives
        comm.send(buf, dst=1, tag=7) if rank == 0 else comm.recv(buf, src=0, tag=7)
        comm.broadcast(buf, src=1)
        comm.all_reduce(buf, "avg")
    assert buf.tolist() == [1.0, 1.0, 1.0]  # the collectives really ran
    mode.generate_json_dump(file_name=f"{out_dir}/rank{rank}.json", noise_level=0)
    dist.barrier()


def test_real_gloo_ranks(tmp_path):
    spawn(_ranks_worker, 2, (str(tmp_path),))
    trees = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, tree in enumerate(trees):
        assert (tree["rank"], tree["world_size"]) == (rank, 2)
        kinds = [(c["collective"], c["reduce_op"], c["src"], c["dst"], c["order"]) for c in tree["collectives"]]
        p2p = ("send", None, 0, 1, 2) if rank == 0 else ("recv", None, 0, 1, 2)
        assert kinds == [("all_reduce", "sum", None, None, 0), ("all_reduce", "sum", None, None, 1), p2p,
                         ("broadcast", None, 1, None, 3), ("all_reduce", "avg", None, None, 4)]
        assert tree["collectives"][2]["tag"] == 7 and tree["collectives"][2]["bytes"] == 12
        layer = next(c for c in tree["children"] if c["fqn"] == "layers.0")
        assert layer["collectives_forward"] == [["all_reduce", 1]]
        assert tree["collectives_forward"] == [["all_reduce", 2], ["send" if rank == 0 else "recv", 1],
                                               ["broadcast", 1]]


@pytest.fixture(scope="module")
def saved_trace(tp_mlp_run, tmp_path_factory):
    from syntorch.export import networkx_json
    path = tmp_path_factory.mktemp("run") / "tensor_trace_graph.json"
    networkx_json.export(tp_mlp_run[0].graph, path)
    return path


def test_cli_reports_a_saved_trace_as_the_live_run(tp_mlp_run, saved_trace, tmp_path, capsys):
    mode, _ = tp_mlp_run
    out = {name: tmp_path / name for name in ("comm.html", "comm.json", "log.txt")}
    assert main(["comm", "--input", str(saved_trace), "--noise_level", "2", "--html", str(out["comm.html"]),
                 "--json", str(out["comm.json"]), "--log", str(out["log.txt"])]) == 0
    live_table = re.sub(r"\x1B\[[0-?]*[ -/]*[@-~]", "", mode.generate_comm_debug_tracing_table(2))
    assert capsys.readouterr().out.startswith(live_table)  # not a terminal: no colours
    assert out["log.txt"].read_text() == live_table
    mode.generate_json_dump(file_name=tmp_path / "live.json", noise_level=2)
    assert json.loads(out["comm.json"].read_text()) == json.loads((tmp_path / "live.json").read_text())
    assert '<li data-fqn="fc2">' in out["comm.html"].read_text()


def test_generation_phases_fall_in_the_forward_pass():
    """TP-2 generation (prefill + 2 decode steps) on the fake backend: per-phase totals are Megatron's."""
    from syntorch.export.comm_report import tracing_table
    from syntorch.generate import generate
    config = tiny_config("gpt2", n_layer=2)
    prompt_len = 5
    with comm.symbolic_world(1, 2):
        model = build_model(config)
        apply_tp(model)
        mode = CommDebugMode(model)
        with mode:
            generate(model, torch.zeros(B, prompt_len, dtype=torch.long), 3, phase_scope=mode.phase)
    totals = mode.report.phase_totals
    per_step = 2 * config.n_layer + 1  # attention and MLP of each layer, and the vocab-parallel embedding
    assert list(totals) == ["prefill", "decode[0]", "decode[1]"]
    for phase, tokens in (("prefill", prompt_len), ("decode[1]", 1)):
        assert totals[phase]["all_reduce"] == [per_step, per_step * B * tokens * config.d_model * 4]
        assert totals[phase]["all_gather"][0] == 1  # the logits, before sampling
    assert mode.get_comm_module_counts()["Global"] == {
        "forward": {"all_reduce": 3 * per_step, "all_gather": 3}, "backward": {}, "optimizer": {}}
    assert "BACKWARD PASS" not in tracing_table(mode.report, 1)
    assert all(c["group"] == [0, 1] for c in mode.get_collectives()) and mode.report.graph_attrs["rank"] == 1


def test_optimizer_phase_has_its_own_section():
    with comm.symbolic_world(0, 2):
        linear = torch.nn.Linear(4, 3)
        mode = CommDebugMode()
        with mode:
            linear(torch.randn(2, 4)).sum().backward()
            with mode.phase("optimizer"):  # DDP-style gradient averaging before the step
                comm.all_reduce(linear.weight.grad, "avg")
    assert mode.get_comm_module_counts() == {"Global": {"forward": {}, "backward": {}, "optimizer": {"all_reduce": 1}}}
    table = mode.generate_comm_debug_tracing_table(1)
    assert "OPTIMIZER STEP" in table and "reduce_op: avg" in table and "bytes: 48" in table
