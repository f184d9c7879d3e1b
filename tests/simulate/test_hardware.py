"""Hardware configs (presets, JSON files, calibration) and the cost model built on them."""
import json

import pytest

from syntorch.cli import main
from syntorch.errors import UserError
from syntorch.hardware import PRESETS, calibrate_cpu, cpu_config_path, load_hw_config, save_cpu_config
from syntorch.simulate.engine import simulate
from syntorch.simulate.graphs import RankFrame, graph_program
from syntorch.trace import cost, kernels
from syntorch.trace.graph import TraceGraph

H100 = PRESETS["h100-sxm"]


def simulated_us(graph) -> float:
    """One rank of `graph` through the simulator (its TP peers run the same graph at the same time)."""
    return simulate([graph_program(graph, "rank", RankFrame({0: 0, 1: 0}))[0]]).end_us


def serial_us(graph, profile: str) -> float:
    """Every kernel's time under `profile`, summed."""
    cost.fill_durations(graph, H100, profile)
    return sum(d["duration_us"] for _, d in graph.work())


def test_presets_carry_datasheet_figures():
    assert load_hw_config("h100-sxm").peak_flops("torch.bfloat16") == pytest.approx(989.4e12)
    assert load_hw_config("a100-80gb").peak_flops("float16") == pytest.approx(312e12)
    assert load_hw_config("h200-sxm").memory_bw_gb_s == 4800.0
    assert load_hw_config("h100-sxm").peak_flops("int64") == pytest.approx(67e12)  # falls back to float32


def test_json_round_trip(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**H100.to_dict(), "name": "mine", "memory_gb": 40}))
    hw = load_hw_config(str(path))
    assert hw.name == "mine" and hw.memory_gb == 40 and hw.peak_tflops == H100.peak_tflops


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("memory_bw_gb_s"), "missing field(s) memory_bw_gb_s"),
    (lambda d: d.update(memory_bw_gb_s=-1), "memory_bw_gb_s must be > 0"),
    (lambda d: d.update(memory_bw_gb_s="fast"), "memory_bw_gb_s must be a number"),
    (lambda d: d.update(devices_per_node=8.5), "devices_per_node must be an integer"),
    (lambda d: d.update(peak_tflops={"bfloat16": 1.0}), "float32 entry"),
    (lambda d: d.update(peak_tflops={"float32": 0}), "peak_tflops.float32 must be > 0"),
    (lambda d: d.update(nvlink=True), "unknown field(s) nvlink"),
    (lambda d: d.pop("sm_count"), "missing field(s) sm_count"),
    (lambda d: d.update(gemm_efficiency=-0.5), "gemm_efficiency must be > 0, got -0.5"),
    (lambda d: d.update(memory_efficiency=1.5), "memory_efficiency is a fraction of a peak, in (0, 1]; got 1.5"),
    (lambda d: d.update(kernel_overhead_us=-1), "kernel_overhead_us must be >= 0, got -1"),
])
def test_bad_json_is_one_line(tmp_path, change, message):
    data = H100.to_dict()
    change(data)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_hw_config(str(path))


def test_unknown_preset_and_missing_cpu_calibration(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="unknown --hw_config 'tpu-v9'"):
        load_hw_config("tpu-v9")
    monkeypatch.setenv("SYNTORCH_CACHE_DIR", str(tmp_path))
    with pytest.raises(UserError, match="run `syntorch calibrate`"):
        load_hw_config("cpu")
    with pytest.raises(UserError, match="not valid JSON"):  # one message for every JSON file (userfiles.py)
        (tmp_path / "broken.json").write_text("{")
        load_hw_config(str(tmp_path / "broken.json"))


def test_calibrate_saves_the_cpu_preset(tmp_path, monkeypatch):
    monkeypatch.setenv("SYNTORCH_CACHE_DIR", str(tmp_path))
    measured = calibrate_cpu(seconds=0.05, matmul_size=128, copy_mb=8)
    assert save_cpu_config(measured) == cpu_config_path() == tmp_path / "cpu.json"
    cpu = load_hw_config("cpu")
    assert cpu.peak_tflops["float32"] > 1e-6 and cpu.memory_bw_gb_s > 1e-3  # 1 MFLOP/s, 1 MB/s: even a loaded machine


def test_calibrate_command(tmp_path, capsys):
    assert main(["calibrate", "--seconds", "0.05", "--output", str(tmp_path / "c.json")]) == 0
    assert "memory bandwidth" in capsys.readouterr().out
    assert load_hw_config(str(tmp_path / "c.json")).name == "cpu"


def test_compute_kernel_is_its_fixed_cost_plus_the_slower_of_math_and_memory():
    # 1 GFLOP with 1 MB is compute-bound; 1 MFLOP with 1 GB is memory-bound.
    o, eff, mem = H100.kernel_overhead_us, H100.gemm_efficiency, H100.memory_efficiency
    assert cost.compute_us(10**9, 10**6, "bfloat16", H100) == pytest.approx(o + 1e6 * 1e9 / (989.4e12 * eff))
    assert cost.compute_us(10**6, 10**9, "bfloat16", H100) == pytest.approx(o + 1e6 * 1e9 / (3350e9 * mem))
    assert cost.compute_us(10**9, 0, "float32", H100) == pytest.approx(o + 1e6 * 1e9 / (67e12 * eff))


def test_gemm_runs_in_waves_of_tiles_over_the_sms():
    o, sms, k = H100.kernel_overhead_us, H100.sm_count, 8192
    one_tile = 2 * 128 * 128 * k / (989.4e12 * H100.gemm_efficiency / sms) * 1e6  # one SM's time for a tile
    full = kernels.gemm_us(1, 128, 128 * sms, k, 0, "bfloat16", H100)  # one tile per SM: one wave
    assert full == pytest.approx(o + one_tile)
    assert kernels.gemm_us(1, 128, 128 * (sms + 1), k, 0, "bfloat16", H100) == pytest.approx(o + 2 * one_tile)
    # fewer tiles than SMs: split-K spreads the work over 2 slices of K, whose FP32 partial sums are
    # written and read back once more
    n = 128 * sms // 2
    reduction = 1e6 * 2 * 2 * 128 * n * 4 / (3350e9 * H100.memory_efficiency)
    assert kernels.gemm_us(1, 128, n, k, 0, "bfloat16", H100) == pytest.approx(o + one_tile / 2 + reduction)
    # a skinny GEMM (4 rows, decode) uses 16-row tiles and is memory-bound on its weights; 64 tiles: 2 slices
    weights = 2 * k * 8192
    assert kernels.gemm_us(1, 4, 8192, k, weights, "bfloat16", H100) == pytest.approx(
        o + 1e6 * (weights + 2 * 2 * 4 * 8192 * 4) / (3350e9 * H100.memory_efficiency))


def nvlink(nbytes, fraction):
    return 1e6 * fraction * nbytes / (450e9 * H100.intra_node_bus_efficiency)


def _tiny_tp_graph():
    g = TraceGraph(rank=0, world_size=2, tp=2)
    x = g.add_tensor([4, 8], "torch.bfloat16", 64)
    w = g.add_tensor([8, 8], "torch.bfloat16", 128, is_param=True)
    y = g.add_tensor([4, 8], "torch.bfloat16", 64)
    g.add_op("aten.mm", [x, w], [y], flops=2 * 4 * 8 * 8, bytes_read=192, bytes_written=64)
    v = g.add_tensor([32], "torch.bfloat16", 64)
    g.add_op("aten.view", [y], [v], is_view=True)
    z = g.add_tensor([32], "torch.bfloat16", 64)
    g.add_collective("all_reduce", [v], [z], group=[0, 1], nbytes=64, reduce_op="sum")
    return g


def test_fill_durations_and_latency():
    g = _tiny_tp_graph()
    cost.fill_durations(g, H100)
    mm, view, ar = (n for n, d in g.nodes(data=True) if d["kind"] != "tensor")
    assert g.nodes[mm]["duration_us"] == pytest.approx(kernels.gemm_us(1, 4, 8, 8, 256, "bfloat16", H100))
    assert g.nodes[view]["duration_us"] == 0.0
    assert g.nodes[ar]["duration_us"] == pytest.approx(
        H100.collective_latency_us + 2 * H100.intra_node_latency_us + nvlink(64, 1))
    total = sum(g.nodes[n]["duration_us"] for n in (mm, view, ar))
    assert simulated_us(g) == pytest.approx(total)  # a chain: no overlap possible


def _mlp_graph():
    """mm -> add(bias) -> gelu -> all_reduce -> add(residual) -> layer norm, as an MLP and the next block's
    first op run them."""
    g = TraceGraph(rank=0, world_size=2, tp=2)
    act = 1024 * 1024 * 2  # [1024, 1024] bf16

    def t(nbytes=act):
        return g.add_tensor([1024, 1024], "bfloat16", nbytes)
    x, w, b, res = t(), t(), g.add_tensor([1024], "bfloat16", 2048), t()
    y, yb, h, r, s, out = t(), t(), t(), t(), t(), t()
    g.add_op("aten.mm", [x, w], [y], flops=2 * 1024**3, bytes_read=2 * act, bytes_written=act)
    g.add_op("aten.add", [y, b], [yb], bytes_read=act + 2048, bytes_written=act)
    g.add_op("aten.gelu", [yb], [h], bytes_read=act, bytes_written=act)
    g.add_collective("all_reduce", [h], [r], group=[0, 1], nbytes=act)
    g.add_op("aten.add", [r, res], [s], bytes_read=2 * act, bytes_written=act)
    g.add_op("aten.native_layer_norm", [s], [out], bytes_read=act, bytes_written=act)
    return g, act


def test_fused_profile_folds_bias_activation_and_residual_into_neighbouring_kernels():
    g, act = _mlp_graph()
    ops = [n for n, d in g.nodes(data=True) if d["kind"] != "tensor"]
    mm, bias, gelu, ar, residual, norm = ops
    cost.fill_durations(g, H100, "eager")
    eager = {n: g.nodes[n]["duration_us"] for n in ops}
    assert all(eager[n] > H100.kernel_overhead_us for n in (bias, gelu, residual))  # one kernel each
    cost.fill_durations(g, H100, "fused")
    fused = {n: g.nodes[n]["duration_us"] for n in ops}
    assert fused[bias] == fused[gelu] == fused[residual] == 0.0
    # the bias joins the GEMM's epilogue (its 2 KB vector is the traffic left), the GeLU too (none left)
    assert fused[mm] == pytest.approx(kernels.gemm_us(1, 1024, 1024, 1024, 3 * act + 2048, "bfloat16", H100))
    # the residual add after the all-reduce joins the layer norm that reads it: one more activation read
    assert fused[norm] == pytest.approx(cost.compute_us(0, 3 * act, "bfloat16", H100))
    assert fused[ar] == eager[ar]
    assert serial_us(g, "fused") < serial_us(g, "eager")


def test_unknown_profile_is_one_line():
    with pytest.raises(UserError, match="unknown --profile 'tuned'; use one of eager, fused"):
        cost.fill_durations(_tiny_tp_graph(), H100, "tuned")


def test_a_collective_overlaps_compute_that_does_not_need_it():
    """Megatron's backward: the input gradient's all-reduce runs while the weight gradient computes."""
    g = TraceGraph(rank=0, world_size=2, tp=2)
    t = lambda: g.add_tensor([1024, 1024], "bfloat16", 2 * 2**20)  # noqa: E731
    grad, w, x, dx, dw, reduced, out = t(), t(), t(), t(), t(), t(), t()
    dgrad = g.add_op("aten.mm", [grad, w], [dx], phase="backward", flops=2 * 2**30)
    wgrad = g.add_op("aten.mm", [grad, x], [dw], phase="backward", flops=2 * 2**30)
    ar = g.add_collective("all_reduce", [dx], [reduced], group=[0, 1], nbytes=2 * 2**20, phase="backward")
    norm = g.add_op("aten.native_layer_norm_backward", [reduced], [out], phase="backward", bytes_read=2**21)
    cost.fill_durations(g, H100, "fused")
    us = {n: g.nodes[n]["duration_us"] for n in (dgrad, wgrad, ar, norm)}
    expected = us[dgrad] + max(us[wgrad], us[ar]) + us[norm]  # the all-reduce starts when dgrad ends
    assert simulated_us(g) == pytest.approx(expected)
    assert simulated_us(g) < sum(us.values())


def test_fused_profile_launches_fewer_kernels_for_a_traced_model():
    import torch

    from conftest import tiny_config
    from syntorch.models import build_model
    from syntorch.trace.tracer import SDPA, Tracer

    model = build_model(tiny_config("gpt2"), device="meta")
    with Tracer(model) as tracer:
        model(torch.zeros(2, 16, dtype=torch.long, device="meta"))
    graph = tracer.graph
    fused_plan = kernels.kernel_plan(graph, "fused")
    assert kernels.kernel_plan(graph, "eager") == {}  # eager: every op that launches a kernel is one
    ops = [n for n, d in graph.node_attrs.items() if d["kind"] == "op" and kernels.launches_kernel(d)]
    joined = [graph.nodes[n]["name"] for n in ops if fused_plan.get(n) == -1]
    # per layer at least the GeLU and the two residual adds join a neighbour
    assert joined.count("aten.gelu") == len(model.layers) and joined.count("aten.add") >= 2 * len(model.layers)
    attention = [n for n in ops if graph.nodes[n]["name"] == SDPA]
    assert len(attention) == len(model.layers) and all(fused_plan.get(n, 0) >= 0 for n in attention)
    assert serial_us(graph, "fused") < serial_us(graph, "eager")
