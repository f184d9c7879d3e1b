"""--dtype fp8 (parallel/fp8.py): the trace carries Transformer Engine's FP8 GEMMs, the cost model times them at
the FP8 peak, devices without FP8 are refused, and a real CPU step in FP8 stays within FP8's error of BF16."""
import collections
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config

from syntorch.cli import main
from syntorch.errors import UserError
from syntorch.hardware import PRESETS, config_from_dict
from syntorch.models import build_model
from syntorch.parallel.fp8 import E4M3, E5M2, AmaxHistory, Fp8Linear, apply_fp8
from syntorch.parallel.plans import TrainPlan
from syntorch.trace import cost, kernels
from syntorch.trace.cost import fill_durations
from syntorch.trace.training import probe_stage

H100 = PRESETS["h100-sxm"]
FP8_DTYPES = {"float8_e4m3fn", "float8_e5m2"}


def probe(config, fp8: bool, mode="train", seq=32, micro_batch_size=2):
    plan = TrainPlan(seq=seq, micro_batch_size=micro_batch_size, mode=mode, fp8=fp8)
    graph, _ = probe_stage(config, plan, 0, torch.bfloat16, microbatches=1)
    return graph


def ops(graph, name):
    return [n for n, d in graph.node_attrs.items() if d["kind"] == "op" and d["name"] == name]


def matrices(graph, node):
    """The GEMM's matrix operands (its scales are 0-dim)."""
    return [graph.node_attrs[t] for t in graph.preds[node] if len(graph.node_attrs[t]["shape"]) == 2]


@pytest.mark.parametrize("mode, gemms_per_linear", [("train", 3), ("infer", 1)])
def test_meta_trace_has_fp8_gemms_with_casts(mode, gemms_per_linear):
    config = tiny_config("gpt2")
    graph = probe(config, fp8=True, mode=mode)
    linears = 4 * config.n_layer  # qkv, proj, fc1, fc2 per block; the LM head stays BF16
    gemms = ops(graph, "aten._scaled_mm")
    assert len(gemms) == gemms_per_linear * linears  # forward, and dgrad + wgrad in training
    for node in gemms:
        operands = matrices(graph, node)
        assert len(operands) == 2 and {d["dtype"] for d in operands} <= FP8_DTYPES
        assert all(d["bytes"] == d["shape"][0] * d["shape"][1] for d in operands)  # one byte per element
        assert cost.op_dtype(graph, node).startswith("float8")
    # one amax per tensor cast: input and weight in forward, the gradient in backward
    casts_per_linear = 2 + (gemms_per_linear > 1)
    assert len(ops(graph, "aten.linalg_vector_norm")) == casts_per_linear * linears
    to_fp8 = collections.Counter(graph.node_attrs[next(iter(graph.succs[n]))]["dtype"]
                                 for n in ops(graph, "aten._to_copy"))
    assert to_fp8["float8_e4m3fn"] == 2 * linears
    assert to_fp8["float8_e5m2"] == (linears if mode == "train" else 0)
    assert len(ops(graph, "aten.mm")) == gemms_per_linear  # only the BF16 head's GEMMs remain


def test_weights_cast_once_per_step():
    # the second micro-batch reuses the first one's FP8 weights (Megatron's is_first_microbatch): one amax each
    config = tiny_config("gpt2")
    plan = TrainPlan(seq=32, micro_batch_size=2, microbatches=2, mode="infer", fp8=True)
    graph, steps = probe_stage(config, plan, 0, torch.bfloat16, microbatches=2)
    norms = [sum(1 for n in range(*steps["F", m, 0]) if graph.node_attrs.get(n, {}).get("name")
                 == "aten.linalg_vector_norm") for m in (0, 1)]
    assert norms == [2 * 4 * config.n_layer, 4 * config.n_layer]


def test_fp8_gemm_timed_at_the_fp8_peak():
    # a large square GEMM is compute-bound: FP8's time is BF16's times the ratio of the achieved peaks, each
    # dtype's datasheet peak at the fraction its best matmul reaches (hardware.py: 0.80 BF16, 0.71 FP8)
    n = 8192
    bf16 = kernels.gemm_us(1, n, n, n, 3 * n * n * 2, "bfloat16", H100)
    fp8 = kernels.gemm_us(1, n, n, n, n * n * (1 + 1 + 2), "float8_e4m3fn", H100)
    overhead = H100.kernel_overhead_us
    assert (fp8 - overhead) / (bf16 - overhead) == pytest.approx(989.4 * 0.80 / (1978.9 * 0.71), rel=1e-3)


def test_fp8_step_faster_than_bf16_on_h100():
    from syntorch.simulate.engine import simulate
    from syntorch.simulate.graphs import RankFrame, graph_program

    config = tiny_config("gpt2", d_model=1024, n_head=8, d_head=128, d_ff=4096, n_positions=1024, vocab_size=256)
    times = {}
    for fp8 in (False, True):
        graph = probe(config, fp8, seq=1024, micro_batch_size=4)
        fill_durations(graph, H100, "fused")
        gemm = sum(graph.node_attrs[n]["duration_us"] for n in graph.node_attrs
                   if graph.node_attrs[n]["kind"] == "op" and graph.node_attrs[n]["name"] in kernels.GEMMS)
        times[fp8] = gemm, simulate([graph_program(graph, "step", RankFrame(), isolated=True)[0]]).end_us
    assert times[True][0] < 0.7 * times[False][0]  # the GEMMs (the head's stay BF16)
    assert times[True][1] < times[False][1]  # the whole step, casts included


def test_fp8_refused_without_fp8_tensor_cores(tmp_path, capsys):
    code = main(["trace", "--model", "gpt2", "--seq", "32", "--dtype", "fp8", "--hw_config", "a100-80gb",
                 "--predict_only", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "fp8" in err and "a100-80gb" in err


def test_fp8_linear_matches_bf16_within_fp8_error():
    # e4m3 keeps 3 mantissa bits (relative rounding <= 2**-4 per element), e5m2 2 bits (<= 2**-3); a dot product
    # averages independent roundings, so whole products stay well inside those bounds
    x = torch.randn(64, 96, dtype=torch.bfloat16, requires_grad=True)
    w = (0.02 * torch.randn(80, 96)).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(64, 80, dtype=torch.bfloat16)
    y8 = Fp8Linear.apply(x, w, AmaxHistory("cpu"))
    y8.backward(grad)
    dx8, dw8 = x.grad, w.grad
    x.grad = w.grad = None
    F.linear(x, w).backward(grad)
    for got, want, bound in ((y8, F.linear(x, w), 2**-4), (dx8, x.grad, 2**-3), (dw8, w.grad, 2**-3)):
        assert torch.linalg.norm((got - want).float()) / torch.linalg.norm(want.float()) < bound
        assert got.dtype == torch.bfloat16


def test_real_cpu_model_step_fp8_close_to_bf16(one_thread):
    config = tiny_config("gpt2", vocab_size=200)
    bf16 = build_model(config, "cpu", torch.bfloat16)
    fp8 = build_model(config, "cpu", torch.bfloat16)
    fp8.load_state_dict(bf16.state_dict())
    assert len(apply_fp8(fp8)) == 4 * config.n_layer
    tokens = torch.randint(0, config.vocab_size, (4, 33))
    losses, grads = [], []
    for model in (bf16, fp8):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    assert F.cosine_similarity(grads[0], grads[1], dim=0) > 0.99
    assert (grads[0] - grads[1]).abs().max() > 0  # the FP8 path did run
    assert {h.amax["grad"].item() > 0 for h in (m.fp8_history for m in fp8.modules() if hasattr(m, "fp8_history"))} \
        == {True}  # every module saw its gradient's amax


def test_fp8_formats_are_transformer_engines_hybrid():
    assert (torch.finfo(E4M3).max, torch.finfo(E5M2).max) == (448.0, 57344.0)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_load_and_validate(name):
    preset = PRESETS[name]
    assert config_from_dict(json.loads(json.dumps(preset.to_dict()))) == preset  # null attention_efficiency too
    older = {k: v for k, v in preset.to_dict().items() if k != "attention_efficiency"}  # files written before it
    assert config_from_dict(older).attention_efficiency is None
    # the FP8 datasheet peak is twice the BF16 one where there is one (Hopper), absent on Ampere
    fp8 = preset.peak_tflops.get("float8_e4m3fn")
    assert fp8 == pytest.approx(2 * preset.peak_tflops["bfloat16"], rel=1e-3) if name != "a100-80gb" else fp8 is None
    with pytest.raises(UserError, match="attention_efficiency is a fraction"):
        config_from_dict({**preset.to_dict(), "attention_efficiency": 1.5})


def test_real_cpu_training_steps_fp8_track_bf16(one_thread):
    # three optimizer steps: the FP8 weights are re-cast after each update (a stale cast would drift from BF16)
    from syntorch.parallel import plans
    from syntorch.parallel.distributed import symbolic_world
    from syntorch.parallel.mesh import init_groups

    config = tiny_config("gpt2", vocab_size=200)
    tokens = torch.randint(0, config.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1))
    batches = [(tokens[:, :-1], tokens[:, 1:])]
    curves = {}
    for fp8 in (False, True):
        torch.manual_seed(0)
        plan = TrainPlan(seq=32, micro_batch_size=4, lr=3e-3, fp8=fp8)
        with symbolic_world(0, 1):
            run = plans.apply_plans(config, plan, init_groups(plan.mesh), "cpu", torch.bfloat16)
            curves[fp8] = []
            for _ in range(3):
                for p in run.model.parameters():
                    p.grad = None
                curves[fp8].append(plans.train_step(run, batches).item())
    assert curves[True][-1] < curves[True][0]  # it learns
    assert curves[True] == pytest.approx(curves[False], rel=2e-2)


def test_symbolic_infer_fp8_faster_than_bf16(tmp_path):
    # `syntorch infer --dtype fp8` on meta: the compute-bound prefill (FP8 peak) and the decode (1-byte weights)
    # both beat BF16 on h100-sxm
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps({"base": "gpt3-1.3b", "n_layer": 2}))
    predicted = {}
    for dtype in ("bf16", "fp8"):
        out = tmp_path / dtype
        assert main(["infer", "--model_config", str(shape), "--device", "meta", "--dtype", dtype, "--batch_size", "8",
                     "--num_input_tokens", "512", "--num_output_tokens", "2", "--hw_config", "h100-sxm",
                     "--profile", "fused", "--out", str(out)]) == 0
        predicted[dtype] = json.loads((out / "run.json").read_text())["predicted"]
    for phase in ("prefill_ms", "decode_ms_per_token"):
        assert predicted["fp8"][phase] < predicted["bf16"][phase]
