"""--attention flash|unfused: the kernel attention runs as, decided in one place (kernels.attention_us), reaches
every command that predicts a time and is recorded beside --profile; the published rows of the validation
bench are the papers' models."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from syntorch.cli import main
from syntorch.export import perfetto
from syntorch.hardware import load_hw_config
from syntorch.models import build_model
from syntorch.trace import Tracer
from syntorch.trace.attention import SDPA, causal_pairs
from syntorch.trace.kernels import attention_us

ROOT = Path(__file__).resolve().parents[2]
A100 = load_hw_config("a100-80gb")


def test_each_kernel_costs_what_its_memory_traffic_and_flops_say():
    """One causal forward, B=4, H=8, S=1024, D=128 in bf16, on A100: hand-counted from the kernels' work."""
    b, h, s, d = 4, 8, 1024, 128
    q = (b, h, s, d)
    io = 4 * b * h * s * d * 2  # q, k, v read, out written
    dense, causal = 4 * b * h * s * s * d, 4 * b * h * causal_pairs(s, s) * d
    scores = b * h * s * s * 2  # one pass over the bf16 score matrix
    peak, bw = 312e12, 2039e9 * A100.memory_efficiency
    overhead = A100.kernel_overhead_us
    # flash: one kernel, the causal FLOPs at FlashAttention-2's fraction of peak (math-bound here)
    flash = overhead + 1e6 * max(causal / (peak * A100.attention_efficiency), io / bw)
    # Megatron's core: QK^T, fused scale-mask-softmax, PV; every score computed, the scores written, read and
    # written by softmax, read by the second GEMM
    megatron = 3 * overhead + 1e6 * (dense / (peak * A100.gemm_efficiency) + (io + 4 * scores) / bw)
    # PyTorch's math path adds the causal mask as a kernel of its own: the scores read and written once more
    math_path = megatron + overhead + 1e6 * 2 * scores / bw
    for attention, profile, expected in (("flash", "fused", flash), ("flash", "eager", flash),
                                         ("unfused", "fused", megatron), ("unfused", "eager", math_path)):
        assert attention_us(SDPA, causal, io, q, q, "bfloat16", A100, profile, attention) == pytest.approx(expected)
    assert flash < megatron < math_path


def test_decode_under_the_fused_profile_is_one_kernel_either_way():
    """FasterTransformer's masked multi-head attention: one kernel for one query, whatever --attention says."""
    q, k = (8, 16, 1, 128), (8, 16, 512, 128)
    flops, nbytes = 4 * 8 * 16 * 512 * 128, 2 * 8 * 16 * 512 * 128 * 2
    times = {a: attention_us(SDPA, flops, nbytes, q, k, "float16", A100, "fused", a) for a in ("flash", "unfused")}
    assert times["flash"] == times["unfused"]


@pytest.fixture(scope="module")
def model_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "m.json"
    path.write_text(json.dumps({"base": "gpt2", "n_layer": 2, "n_positions": 2048}))
    return str(path)


def test_trace_records_the_attention_kernel_and_predict_replays_it(tmp_path, model_json):
    plan = ["--model", "gpt2", "--model_config", model_json, "--tp", "2", "--pp", "2", "--microbatches", "2",
            "--seq", "2048", "--hw_config", "a100-80gb", "--profile", "fused", "--no_progress"]
    steps = {}
    for attention in ("flash", "unfused"):
        out = tmp_path / attention
        assert main(["trace", *plan, "--attention", attention, "--out", str(out)]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["attention"] == summary["predicted"]["attention"] == attention
        written = json.loads((out / "syntorch_ranks.json").read_text())["durations"]
        assert (written["profile"], written["attention"]) == ("fused", attention)
        steps[attention] = summary["predicted"]["step_s"]
        # predict DIR replays the files' durations, and says with which kernel
        assert main(["predict", str(out), "--out", str(tmp_path / f"p-{attention}")]) == 0
        replayed = json.loads((tmp_path / f"p-{attention}" / "prediction.json").read_text())["predicted"]
        assert f"--attention {attention}), replayed" in replayed["notes"][1]
        assert replayed["attention"] == attention and replayed["step_s"] == pytest.approx(steps[attention], rel=0.01)
    # 2,048 tokens: the unfused core's score matrix through memory costs more than the flash kernel
    assert steps["unfused"] > steps["flash"]
    # another kernel than the files': not replayed, costed again
    assert main(["predict", str(tmp_path / "flash"), "--hw_config", "a100-80gb", "--profile", "fused", "--attention",
                 "unfused", "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "prediction.json").read_text())["predicted"]
    assert "replayed" not in again["notes"][1] and again["attention"] == "unfused"


def test_infer_records_the_attention_kernel(tmp_path, model_json):
    latency = {}
    for attention in ("flash", "unfused"):
        out = tmp_path / attention
        assert main(["infer", "--model", "gpt2", "--model_config", model_json, "--device", "meta", "--num_input_tokens", "1024",
                     "--num_output_tokens", "2", "--hw_config", "a100-80gb", "--attention", attention,
                     "--out", str(out)]) == 0
        record = json.loads((out / "run.json").read_text())
        assert record["trace"]["attention"] == record["predicted"]["attention"] == attention
        latency[attention] = record["predicted"]["prefill_ms"]
    assert latency["unfused"] > latency["flash"]


def test_perfetto_export_times_attention_with_the_kernel_asked_for():
    model = build_model(tiny_config("gpt2", n_positions=512))
    with Tracer(model) as tracer:
        model(torch.randint(0, 128, (1, 512)))
    ends = {}
    for attention in ("flash", "unfused"):
        slices = [e for e in perfetto.trace_events(tracer.graph.copy(), "a100-80gb", "eager", attention)["traceEvents"]
                  if e["ph"] == "X"]
        ends[attention] = max(e["ts"] + e["dur"] for e in slices)
    assert ends["unfused"] > ends["flash"]


@pytest.mark.parametrize("argv", [["trace", "--attention", "unfused"], ["infer", "--attention", "unfused"],
                                  ["trace", "--attention", "sparse"]])
def test_an_attention_kernel_without_hardware_or_unknown_is_one_line(argv, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--attention" in err


def test_the_validation_rows_are_the_papers_models():
    """Narayanan et al. Eq. 2 gives each Table 1 row's published parameter count from the shapes transcribed,
    and each row's layout divides its GPUs and batch."""
    spec = importlib.util.spec_from_file_location("validate_published", ROOT / "bench" / "validate_published.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for row in bench.NARAYANAN:
        assert row.params() / 1e9 == pytest.approx(float(row.label.split("B")[0]), abs=0.06)
    for row in bench.NARAYANAN + bench.KORTHIKANTI:
        plan = row.plan
        assert plan.dp * plan.tp * plan.pp == row.gpus
        assert plan.dp * plan.microbatches * plan.micro_batch_size == row.batch
