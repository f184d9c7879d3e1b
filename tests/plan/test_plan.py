"""`syntorch plan` (issue 25): the enumeration against a hand count, memory pruning against memory.estimate,
a cached prediction against `syntorch trace --predict_only`, the outputs against each other, worker processes
and Ray against one process, bad inputs. Tiny models, a handful of layouts each."""
import csv
import dataclasses
import json

import pytest
import torch
from conftest import tiny_config

from syntorch.cli import main
from syntorch.config import save_model_config
from syntorch.hardware import PRESETS, load_hw_config
from syntorch.parallel import memory
from syntorch.parallel.plans import TrainPlan
from syntorch.plan.evaluate import ProbeCache, predict_plan
from syntorch.plan.search import search
from syntorch.plan.space import Choices, MemoryModel, Work, layer_split, layouts

A100 = PRESETS["a100-80gb"]
TINY = tiny_config("gpt2", n_layer=4, n_positions=128)  # 4 layers, 4 heads, d_model 64
# four layouts of 4 GPUs: TP2 x DP2 or TP2 x PP2, micro-batches of 1 or 2
SMALL = Choices(tp=(2,), pp=(1, 2), virtual_stages=(1,), micro_batch_size=(1, 2), zero=(0,), recompute=("none",))
SMALL_WORK = Work(gpus=4, global_batch=4, seq=32)


def test_enumeration_matches_a_hand_count():
    """8 GPUs, batch 4: TP 2/4/8 (SP on) x PP 1/2/4 x V 1/2 (V 2 only with PP) x micro-batch 1/2 = 3 x 5 x 2 = 30
    layouts. TP x PP must divide 8: TP8 PP2, TP8 PP4, TP4 PP4 (2 + 2, 2 + 2, 2 + 2 = 12) go; TP 8 exceeds the 4
    heads (PP1: 2); 4 layers do not make PP4 x V2 chunks (TP2 PP4 V2: 2); DP4 x 2 does not divide 4 (TP2 PP1
    mbs2: 1); TP2 PP2 V2 mbs2 has 1 micro-batch, not a multiple of PP (1). 12 are left."""
    choices = Choices(tp=(1, 2, 4, 8), pp=(1, 2, 4), virtual_stages=(1, 2), micro_batch_size=(1, 2), zero=(0,),
                      recompute=("none",))
    pruned = {}
    plans = layouts(TINY, Work(gpus=8, global_batch=4, seq=64), choices, pruned)
    assert pruned == {"gpus": 12, "tp": 2, "layers": 2, "batch": 1, "interleave": 1}
    assert sorted((p.tp, p.pp, p.virtual_stages, p.micro_batch_size) for p in plans) == [
        (2, 1, 1, 1), (2, 2, 1, 1), (2, 2, 1, 2), (2, 2, 2, 1), (2, 4, 1, 1), (2, 4, 1, 2),
        (4, 1, 1, 1), (4, 1, 1, 2), (4, 2, 1, 1), (4, 2, 1, 2), (4, 2, 2, 1), (4, 2, 2, 2)]
    assert all(p.sp and p.dp * p.tp * p.pp == 8 and p.dp * p.microbatches * p.micro_batch_size == 4 for p in plans)


def test_layer_split_is_megatrons_first_that_divides():
    assert layer_split(96, 8, 1) == {}  # even
    assert layer_split(126, 16, 1) == dict(account_for_embedding=True, account_for_loss=True)  # Llama 3 405B: 7/8/7
    assert layer_split(29, 4, 1) == dict(first_stage_layers=6, last_stage_layers=7)  # 8 x 2 in the middle
    assert layer_split(4, 4, 2) is None


@pytest.mark.parametrize("plan", [
    TrainPlan(dp=2, tp=2, pp=4, sp=True, microbatches=8, seq=64),
    TrainPlan(dp=4, pp=2, zero=3, microbatches=4, micro_batch_size=2, seq=64, recompute="full"),
    TrainPlan(dp=2, pp=4, virtual_stages=2, microbatches=4, seq=64, zero=1),
    TrainPlan(dp=1, tp=2, pp=3, microbatches=6, seq=64, first_stage_layers=1, last_stage_layers=1,
              recompute="selective")])
def test_memory_model_is_memory_estimate(plan):
    config = dataclasses.replace(TINY, n_layer=6 if plan.pp == 3 else 8)
    totals = [memory.estimate(config, plan, torch.bfloat16, s)["total"] for s in range(plan.pp)]
    model = MemoryModel(config, torch.bfloat16)
    assert [model.stage_bytes(plan, s) for s in range(plan.pp)] == totals
    assert model.peak(plan) == max(totals)


def test_memory_pruning_follows_the_estimate():
    """A limit between the layouts' estimates: exactly those estimated above it are pruned."""
    choices = dataclasses.replace(SMALL, recompute=("none", "full"))
    plans = layouts(TINY, SMALL_WORK, choices, {})
    peaks = {p: max(memory.estimate(TINY, p, torch.bfloat16, s)["total"] for s in range(p.pp)) for p in plans}
    limit = sorted(peaks.values())[len(peaks) // 2] / 1e9
    result = search(TINY, SMALL_WORK, choices, [A100], max_memory_gb=limit, all_recompute=True)
    assert result.pruned["memory"] == {A100.name: sum(v > limit * 1e9 for v in peaks.values())}
    assert sorted(r["memory_gb"] for r in result.rows) == sorted(v / 1e9 for v in peaks.values() if v <= limit * 1e9)


@pytest.mark.parametrize("options, plan, layers", [
    ("--dp 2 --tp 2 --pp 2 --sp --zero 1", TrainPlan(dp=2, tp=2, pp=2, sp=True, microbatches=4, seq=32, zero=1), 4),
    # FSDP over 6 alike layers: a layer probe (four layers, trace/layer_probe.py) with its own optimizer graph
    ("--dp 2 --zero 3", TrainPlan(dp=2, zero=3, microbatches=4, seq=32), 6)])
def test_cached_prediction_is_trace_predict_only(options, plan, layers, tmp_path, capsys):
    """The same numbers as the command, from probes traced for another micro-batch count (the same probe key),
    also after the durations were filled for another machine."""
    config = dataclasses.replace(TINY, n_layer=layers)
    save_model_config(config, tmp_path / "tiny.json")
    assert main(["trace", "--model_config", str(tmp_path / "tiny.json"), *options.split(), "--microbatches", "4",
                 "--seq", "32", "--predict_only", "--hw_config", "a100-80gb", "--profile", "fused",
                 "--out", str(tmp_path / "trace")]) == 0
    capsys.readouterr()
    expected = json.loads((tmp_path / "trace" / "summary.json").read_text())["predicted"]
    cache = ProbeCache()
    other = predict_plan(config, dataclasses.replace(plan, microbatches=8), PRESETS["h100-sxm"], cache).summary
    summary = predict_plan(config, plan, A100, cache).summary
    assert cache.traced == 2 and other["step_s"] != summary["step_s"]  # two stages, or kept layers and the end
    assert bool(cache.ends) == (plan.zero == 3)  # kept layers with the whole stage's end, or whole
    for key in ("step_s", "bubble_fraction", "exposed_comm_s", "mfu"):
        assert summary[key] == expected[key], key
    # the other machine's durations come back on the same probes
    h100 = predict_plan(config, plan, PRESETS["h100-sxm"], cache).summary
    assert cache.traced == 2 and h100["step_s"] == predict_plan(config, plan, PRESETS["h100-sxm"]).summary["step_s"]


def test_cli_outputs_agree(tmp_path, capsys):
    save_model_config(TINY, tmp_path / "tiny.json")
    out = tmp_path / "out"
    assert main(["plan", "--model_config", str(tmp_path / "tiny.json"), "--gpus", "4", "--hw_config", "a100-80gb",
                 "--tokens_per_step", "128", "--seq", "32", "--tp", "2", "--virtual_stages", "1", "--zero", "0",
                 "--no_recompute", "--micro_batch_size", "1,2", "--workers", "1", "--emit", "1", "--out", str(out),
                 "--no_progress"]) == 0
    printed = capsys.readouterr().out
    rows = list(csv.DictReader(open(out / "plans.csv")))
    record = json.loads((out / "plans.json").read_text())
    assert len(rows) == len(record["layouts"]) == 4 and record["enumerated"] == 6  # TP2 x PP4 > 4 GPUs
    assert record["pruned"]["tp x pp x cp divides the GPUs"] == 2
    for row, layout in zip(rows, record["layouts"]):
        assert (row["name"], float(row["step_s"]), float(row["memory_gb"])) == \
               (layout["name"], layout["step_s"], layout["memory_gb"])
    steps = [r["step_s"] for r in record["layouts"]]
    assert steps == sorted(steps) and [r["rank"] for r in record["layouts"]] == [1, 2, 3, 4]
    assert record["layouts"][0]["name"] in printed
    assert (out / "plans.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    emitted = out / f"top1_{record['layouts'][0]['name'].replace(' ', '_')}"
    summary = json.loads((emitted / "summary.json").read_text())
    assert summary["predicted"]["step_s"] == record["layouts"][0]["step_s"]
    assert main(["validate", str(emitted)]) == 0


def small_search(**kw):
    return search(TINY, SMALL_WORK, SMALL, [A100], **kw)


@pytest.fixture(scope="module")
def one_process():
    """The small search in this process, which both the workers' and Ray's rows are held against."""
    return small_search(workers=1)


def test_workers_give_the_rows_of_one_process(one_process):
    assert len(one_process.rows) == 4 and one_process.probes == 2  # DP2 or PP2: two groups sharing probes
    assert small_search(workers=2).rows == one_process.rows


def start_local_ray(ray, attempts: int = 2) -> None:
    """ray.init on 2 CPUs. Ray gives its raylet a fixed 30 s to register (ray/_private/node.py), which a
    2-core machine under load can miss: then once more, and a skip that says so."""
    for attempt in range(attempts):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            return
        except Exception as e:  # Ray raises a bare Exception for it
            ray.shutdown()
            if "timed out during startup" not in str(e):
                raise
    pytest.skip("Ray's raylet did not start within its fixed 30 s (machine overloaded)")


def test_ray_gives_the_rows_of_one_process(one_process):
    ray = pytest.importorskip("ray")
    start_local_ray(ray)
    try:
        on_ray = small_search(ray_address="auto")
    finally:
        ray.shutdown()
    assert on_ray.rows == one_process.rows


def test_hardware_file_may_change_one_figure_of_a_preset(tmp_path):
    path = tmp_path / "h100-ib2x.json"
    path.write_text(json.dumps({"base": "h100-sxm", "inter_node_bw_gb_s": 100}))
    hw = load_hw_config(str(path))
    assert hw == dataclasses.replace(PRESETS["h100-sxm"], name="h100-ib2x", inter_node_bw_gb_s=100)


@pytest.mark.parametrize("options, message", [
    (["--max_memory_gb", "0.0001"], "the last fell to 'memory estimate within the device' (the smallest needs"),
    (["--gpus", "12", "--gpus_per_node", "8"], "--gpus 12 is not a whole number of 8-GPU nodes"),
    (["--gpus", "7"], "the last fell to 'tp x pp x cp divides the GPUs'"),
    (["--model", "no-such-model", "--model_config", ""], "no-such-model"),
    (["--tokens_per_step", "100"], "--tokens_per_step 100 is not a whole number of --seq 32 sequences"),
])
def test_bad_input_is_one_line_exit_2_and_no_folder(options, message, tmp_path, capsys):
    save_model_config(TINY, tmp_path / "tiny.json")
    argv = ["plan", "--model_config", str(tmp_path / "tiny.json"), "--gpus", "4", "--hw_config", "a100-80gb",
            "--global_batch", "4", "--seq", "32", "--tp", "2", "--zero", "0", "--no_progress",
            "--out", str(tmp_path / "out")]
    for i, option in enumerate(options[::2]):  # a given option replaces the default's value
        if option in argv:
            j = argv.index(option)
            del argv[j:j + 2]
        if option == "--tokens_per_step":
            del argv[argv.index("--global_batch"):argv.index("--global_batch") + 2]
    argv += [x for x in options if x != ""]
    if "--model" in options:
        del argv[argv.index("--model_config"):argv.index("--model_config") + 2]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_the_dp_degree_changes_the_probe_so_it_is_in_the_key():
    """ZeRO shards and the DP gradient collectives' groups follow DP: probes of DP 2 and DP 4 differ."""
    from syntorch.workload import trace_workload

    def collectives(dp):
        plan = TrainPlan(dp=dp, tp=2, sp=True, zero=1, microbatches=2, seq=32)
        graph = trace_workload(TINY, plan, torch.bfloat16, schedule=False).probes[0][0]
        return sorted((d["collective"], len(d["group"]), d["bytes"]) for _, d in graph.collectives())

    two, four = collectives(2), collectives(4)
    assert len(two) == len(four) and two != four  # the same collectives over other groups and shards


def test_compare_hw_ranks_each_machine_from_the_same_probes():
    h100 = PRESETS["h100-sxm"]
    both = search(TINY, SMALL_WORK, SMALL, [A100, h100])
    assert both.probes == 2 and len(both.rows) == 8
    assert [r["rank"] for r in both.rows] == [1, 2, 3, 4] * 2
    alone = search(TINY, SMALL_WORK, SMALL, [h100]).rows
    assert [(r["name"], r["step_s"]) for r in both.rows if r["hw"] == "h100-sxm"] == \
           [(r["name"], r["step_s"]) for r in alone]


def test_expert_layouts_are_carved_out_of_each_stage_ranks_for_moe_models_only():
    """EP takes the divisors of the experts, ETP 1 and TP, both carved out of a stage's TP x CP x DP ranks
    (Megatron-Core's expert rank generator): with CP and FSDP too. At TP 1 the two ETP values are one layout.
    A dense model gets EP 1 and ETP = TP only."""
    moe = tiny_config("mixtral-8x22b", n_layer=2, n_kv_head=2, d_ff=64, n_experts=4, n_positions=64)
    choices = Choices(tp=(1, 2), pp=(1,), cp=(1, 2), micro_batch_size=(1,), recompute=("none",), sp=(False,))
    plans = layouts(moe, Work(gpus=8, global_batch=8, seq=64), choices, {})
    assert len(plans) == len(set(plans))
    assert {p.ep for p in plans} == {1, 2, 4} and {(p.tp, p.etp) for p in plans} == {(1, 1), (2, 1), (2, 2)}
    assert all((p.tp // p.etp * p.cp * p.dp) % p.ep == 0 for p in plans)
    assert any(p.ep > 1 and p.cp > 1 for p in plans) and any(p.ep > 1 and p.zero == 3 for p in plans)
    assert not any(p.tp == 2 and p.etp == 2 and p.cp == 1 and p.dp == 1 and p.ep == 4 for p in plans)  # 2 x 4 > 4
    dense = layouts(TINY, Work(gpus=8, global_batch=8, seq=64), choices, {})
    assert {p.ep for p in dense} == {1} and all(p.etp == p.tp for p in dense)


def test_a_search_whose_every_layout_the_prediction_refuses_is_one_line(monkeypatch, tmp_path, capsys):
    from syntorch.errors import UserError
    from syntorch.plan import evaluate

    def refuse(*args, **kwargs):
        raise UserError("--sp is not supported for this model")
    monkeypatch.setattr(evaluate, "predict_plan", refuse)
    save_model_config(TINY, tmp_path / "tiny.json")
    assert main(["plan", "--model_config", str(tmp_path / "tiny.json"), "--gpus", "4", "--hw_config", "a100-80gb",
                 "--global_batch", "4", "--seq", "32", "--tp", "2", "--zero", "0", "--workers", "1", "--no_progress",
                 "--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert "no layout could be predicted" in err and "--sp is not supported for this model" in err
    assert not (tmp_path / "out").exists()
