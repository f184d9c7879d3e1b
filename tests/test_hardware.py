"""Hardware configs (presets, JSON files, calibration) and the cost model built on them."""
import json
import math

import pytest

from syntorch.cli import main
from syntorch.errors import UserError
from syntorch.hardware import PRESETS, calibrate_cpu, cpu_config_path, load_hw_config, save_cpu_config
from syntorch.trace import cost
from syntorch.trace.graph import TraceGraph

H100 = PRESETS["h100-sxm"]


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


def test_compute_roofline():
    # 1 GFLOP with 1 MB is compute-bound; 1 MFLOP with 1 GB is memory-bound.
    assert cost.compute_us(10**9, 10**6, "bfloat16", H100) == pytest.approx(1e6 * 1e9 / 989.4e12)
    assert cost.compute_us(10**6, 10**9, "bfloat16", H100) == pytest.approx(1e6 * 1e9 / 3350e9)
    assert cost.compute_us(10**9, 0, "float32", H100) == pytest.approx(1e6 * 1e9 / 67e12)


def test_ring_alpha_beta():
    mb = 10**6
    bw, lat = 450e9, 2.0
    assert cost.collective_us("all_reduce", mb, list(range(8)), H100) == pytest.approx(14 * lat + 1e6 * 2 * 7 / 8 * mb / bw)
    assert cost.collective_us("reduce_scatter", mb, list(range(8)), H100) == pytest.approx(7 * lat + 1e6 * 7 / 8 * mb / bw)
    assert cost.collective_us("all_gather", mb, list(range(8)), H100) == pytest.approx(7 * lat + 1e6 * 7 / 8 * mb / bw)
    assert cost.collective_us("send", mb, [0, 1], H100) == pytest.approx(lat + 1e6 * mb / bw)
    # ranks 0 and 8 sit in different nodes: InfiniBand figures
    assert cost.collective_us("all_reduce", mb, [0, 8], H100) == pytest.approx(2 * 5.0 + 1e6 * mb / 50e9)
    assert cost.collective_us("all_reduce", mb, [3], H100) == 0.0


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
    assert g.nodes[mm]["duration_us"] == pytest.approx(1e6 * 256 / 3350e9)  # tiny: memory-bound
    assert g.nodes[view]["duration_us"] == 0.0
    assert g.nodes[ar]["duration_us"] == pytest.approx(2 * 2.0 + 1e6 * 64 / 450e9)
    est = cost.latency_us(g)
    total = sum(g.nodes[n]["duration_us"] for n in (mm, view, ar))
    assert est["serial_us"] == pytest.approx(total)
    assert est["critical_path_us"] == pytest.approx(total)  # a chain: no overlap possible
    assert math.isclose(cost.latency_us(g, H100)["serial_us"], total)
