"""HardwareConfig and its presets (--hw_config NAME|FILE.json).

Units are the ones datasheets print, so a JSON file reads like one: TFLOP/s, GB/s (10^9 bytes per
second, one direction), GB (10^9 bytes), microseconds. `cost.py` turns them into per-node durations.
"""
import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from syntorch.errors import UserError
from syntorch.userfiles import read_json


@dataclass(frozen=True)
class HardwareConfig:
    name: str
    peak_tflops: dict[str, float]  # dense peak per dtype ("float32" required; others fall back to it)
    memory_bw_gb_s: float  # device memory bandwidth
    memory_gb: float  # device memory capacity
    intra_node_bw_gb_s: float  # per device, one direction, to a device in the same node
    intra_node_latency_us: float  # per ring step
    inter_node_bw_gb_s: float  # per device, one direction, to a device in another node (its own NIC)
    inter_node_latency_us: float  # per ring step
    devices_per_node: int
    # --- the performance model (trace/kernels.py, trace/nccl.py): what a device achieves of the above
    sm_count: int  # streaming multiprocessors: the waves a GEMM's tiles run in
    gemm_efficiency: float  # fraction of peak a full wave of GEMM tiles reaches (cuBLAS, large shapes)
    memory_efficiency: float  # fraction of memory bandwidth a streaming kernel reaches
    kernel_overhead_us: float  # fixed cost of every kernel: launch, ramp-up and tail
    intra_node_bus_efficiency: float  # NCCL bus bandwidth / link bandwidth inside a node (nccl-tests busbw)
    inter_node_bus_efficiency: float  # the same across nodes, per NIC
    collective_latency_us: float  # fixed cost of one NCCL collective (launch and synchronisation), beside its steps
    # fraction of peak the flash-attention kernel reaches (FLOPs as counted); None: gemm_efficiency
    attention_efficiency: float | None = None
    # fixed cost of one NCCL send/recv beside its link step: NCCL src/graph/tuning.cc baseLat[Ring][Simple],
    # 8.4 us, the protocol of pipeline-sized messages (not fitted)
    p2p_latency_us: float = 8.4
    # host time eager PyTorch spends issuing one kernel (Python, the dispatcher, cudaLaunchKernel): the `eager`
    # profile's kernels start no earlier than the host issues them (trace/cost.py, add_host_waits). 0: the host
    # is never the bottleneck (a CPU device, whose kernel_overhead_us is the dispatch itself)
    host_overhead_us: float = 0.0

    def peak_flops(self, dtype: str) -> float:
        """FLOP/s for a dtype name ("bfloat16" or "torch.bfloat16"); unknown dtypes use float32's peak."""
        dtype = dtype.removeprefix("torch.")
        return 1e12 * self.peak_tflops.get(dtype, self.peak_tflops["float32"])

    def math_efficiency(self, kind: str = "gemm") -> float:
        """The fraction of peak math a kernel reaches: "gemm" (and any kernel's math), or "attention"."""
        if kind == "attention" and self.attention_efficiency is not None:
            return self.attention_efficiency
        return self.gemm_efficiency

    def to_dict(self) -> dict:
        return asdict(self)


# NVLink and InfiniBand figures are per direction: NVIDIA prints NVLink as the bidirectional total
# (600 GB/s A100, 900 GB/s H100/H200 -> 300 / 450 GB/s each way) and InfiniBand in Gbit/s per port
# (HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s; DGX nodes have one port per GPU).
# Latency per ring step: inside a node, fitted (below; NCCL's own tuning model, src/graph/tuning.cc hwLat,
# has 1.9 us per NVLink step for its LL128 ring); across nodes NCCL's LL128 ring figure, 4 us per network
# step (not calibrated: no multi-node table).
# SM counts: NVIDIA A100 Tensor Core GPU Architecture whitepaper (108 SMs), H100 whitepaper (132 SMs, SXM5).
#
# Fitted once, together, by `python bench/fidelity.py --fit` (Nelder-Mead on the mean of the two tables'
# MAPEs) to ../shared/calibration: FasterTransformer GPT-20B inference latencies at TP 1/2/4/8 (174 cells)
# and Megatron-LM 22B per-layer forward/backward times (Korthikanti et al. 2022, Table 4), all on
# A100-80GB SXM. Four figures, each a physical quantity; values rounded:
#   gemm_efficiency 0.67       cuBLAS FP16 GEMMs reach ~2/3 of the 312 TFLOP/s tensor-core peak
#   memory_efficiency 0.74     streaming kernels (decode GEMV, layer norm, KV-cache attention) ~1.5 TB/s
#   collective_latency_us 50   one all-reduce call's fixed cost beside NCCL's ring steps (FT's TP scaling)
#   intra_node_latency_us 2.2  per ring step over NVLink (NCCL's tuning model says 1.9 for LL128)
# Not fitted: kernel_overhead_us 2 (the GPU-side gap between back-to-back kernels of one stream; launches
# are asynchronous), and the bus efficiencies, vendor benchmarks: nccl-tests all_reduce bus bandwidth on
# DGX A100 (~230 GB/s of NVLink's 300: 0.77) and across HDR InfiniBand (~23 GB/s of 25 per NIC: 0.92).
# A100_FLASH, the flash kernel's attention_efficiency (--attention flash): a published component measurement, not
# fitted. FlashAttention-2 reaches "50-73% of the theoretical maximum FLOPs/s on A100" (Dao 2023, arXiv:2307.08691,
# abstract and section 4.1: A100 80GB SXM4, head dim 64 and 128, causal or not, FLOPs counted as here with causal
# halved); 0.6 is the middle of that range. The two A100 tables ran the unfused core (--attention unfused), so
# it moves none of their prefill or training figures; decode's attention is memory-bound.
A100_FIT = dict(gemm_efficiency=0.67, memory_efficiency=0.74, kernel_overhead_us=2.0, collective_latency_us=50.0)
A100_FLASH = 0.6
NCCL_BUS = dict(intra_node_bus_efficiency=0.77, inter_node_bus_efficiency=0.92)
# Hopper (H100 SXM5 and H200 SXM share the GH100 die, clocks and NVLink 4): published component measurements,
# none fitted, none taken from the H100 whole-step table (bench/fidelity.py only checks against it):
#   gemm_efficiency 0.80       cuBLAS BF16 matmul at its best full-wave shape, 792.1 of 989 TFLOP/s (Bekman,
#                              ml-engineering, compute/accelerator "Maximum Achievable Matmul FLOPS", H100 SXM,
#                              CUDA 12.1); FP8 reaches the same fraction of its doubled peak: cuBLASLt e4m3 8192^3,
#                              1,599-1,630 TFLOP/s of 1,979 on 16 H100 SXM (0.81; d-robotics test_gpu_scripts,
#                              reports_cublaslt_fp8_crosscheck_20260524.md), so one fraction serves both dtypes.
#   attention_efficiency 0.35  FlashAttention-2, the flash kernel PyTorch's SDPA runs (the eager profile's
#                              attention), reaches ~35% of the H100's peak (Shah et al. 2024, FlashAttention-3,
#                              pytorch.org blog 2024-07-11); FA3 reaches 649 TFLOP/s fwd at head dim 128 (0.66) and
#                              cuDNN's fused attention ~450-510 at head dim 256 (paper Fig. 5), not used here.
#   memory_efficiency 0.84     coalesced HBM3 loads measured at 2.8 of 3.35 TB/s with Nsight Compute on H100 SXM5
#                              (mikamirai.com "GPU Memory Bandwidth", 2026: a blog measurement, the best found).
#   intra_node_bus_efficiency 0.82  nccl-tests all_reduce, NCCL's ring, 8 GPUs of an HGX H100: 741 GB/s
#                              bidirectional busbw = 371 of 450 each way (ASTRA-sim docs, "Validation on GPU
#                              Systems - NCCL over HGX-H100"); NVLink SHARP (NVLS) all_reduce reaches 460-480,
#                              but reduce-scatter and all-gather, most of Megatron's traffic, do not use it.
#   inter_node_bus_efficiency 0.92  kept from HDR (no NDR nccl-tests figure found): ~46 GB/s of NDR's 50 per NIC.
# Kept from the A100 fit (no Hopper measurement of them): kernel_overhead_us, collective_latency_us, the latencies.
#
# EAGER_HOST_US, host_overhead_us of the GPU presets: a published component measurement, not fitted. Eager
# PyTorch's host cost per CUDA op, issued back to back with one synchronisation at the end (so the asynchronous
# queue hides the kernels): 8 us per torch.add on an A100 system (flagos-ai/Torch-FL pull request 27, "FlagGems
# Python vs vendor dispatch-overhead microbenchmark", vendor CUDA path, column cuda_sub, 2026). Consistent with
# torch.add's size-independent 7.1 us floor per call on A100 for (1, 4096) and (16, 4096) BF16 tensors
# (flagos-ai/FlagGems issue 4558) and with Meta's Holistic Trace Analysis docs ("the launch time on the CPU
# side is between 5-20 microseconds", docs/source/features/cuda_kernel_launch_stats.rst). It is the host's
# figure (CPU, Python, driver), so Hopper nodes keep it.
EAGER_HOST_US = 8.0
HOPPER = dict(gemm_efficiency=0.80, attention_efficiency=0.35, memory_efficiency=0.84, kernel_overhead_us=2.0,
              collective_latency_us=50.0, intra_node_bus_efficiency=0.82, inter_node_bus_efficiency=0.92)
# FP8 (e4m3 and e5m2) tensor-core peak, dense: the H100/H200 datasheets print 3,958 TFLOPS with sparsity.
HOPPER_PEAK = {"float32": 67.0, "bfloat16": 989.4, "float16": 989.4, "float8_e4m3fn": 1978.9, "float8_e5m2": 1978.9}
PRESETS: dict[str, HardwareConfig] = {c.name: c for c in [
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): FP32 19.5 TFLOPS (no tensor cores; PyTorch
    # keeps TF32 off for matmuls by default), BF16/FP16 tensor core 312 TFLOPS dense (624 with
    # sparsity), HBM2e 2,039 GB/s, 80 GB, NVLink 3 600 GB/s. DGX A100: 8 GPUs, 8x HDR 200 Gb/s. No FP8.
    HardwareConfig("a100-80gb", {"float32": 19.5, "bfloat16": 312.0, "float16": 312.0},
                   memory_bw_gb_s=2039.0, memory_gb=80.0,
                   intra_node_bw_gb_s=300.0, intra_node_latency_us=2.2,
                   inter_node_bw_gb_s=25.0, inter_node_latency_us=4.0, devices_per_node=8,
                   sm_count=108, attention_efficiency=A100_FLASH, host_overhead_us=EAGER_HOST_US, **A100_FIT,
                   **NCCL_BUS),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): FP32 67 TFLOPS, BF16/FP16 tensor core 1,979 TFLOPS
    # with sparsity = 989.4 dense, FP8 3,958 with sparsity = 1,979 dense, HBM3 3.35 TB/s, 80 GB,
    # NVLink 4 900 GB/s. DGX H100: 8 GPUs, 8x ConnectX-7 NDR 400 Gb/s.
    HardwareConfig("h100-sxm", HOPPER_PEAK, memory_bw_gb_s=3350.0, memory_gb=80.0,
                   intra_node_bw_gb_s=450.0, intra_node_latency_us=2.2,
                   inter_node_bw_gb_s=50.0, inter_node_latency_us=4.0, devices_per_node=8,
                   sm_count=132, host_overhead_us=EAGER_HOST_US, **HOPPER),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): same Hopper compute as H100 SXM (FP32 67, BF16/FP16
    # 1,979 sparse = 989.4 dense, FP8 3,958 sparse = 1,979 dense TFLOPS), HBM3e 4.8 TB/s, 141 GB,
    # NVLink 900 GB/s. DGX H200: 8 GPUs, 8x NDR 400 Gb/s. Its HBM3e fraction is taken as H100's HBM3 one.
    HardwareConfig("h200-sxm", HOPPER_PEAK, memory_bw_gb_s=4800.0, memory_gb=141.0,
                   intra_node_bw_gb_s=450.0, intra_node_latency_us=2.2,
                   inter_node_bw_gb_s=50.0, inter_node_latency_us=4.0, devices_per_node=8,
                   sm_count=132, host_overhead_us=EAGER_HOST_US, **HOPPER),
]}


def cpu_config_path() -> Path:
    """Where `syntorch calibrate` saves the `cpu` preset: $SYNTORCH_CACHE_DIR, else
    $XDG_CACHE_HOME/syntorch, else ~/.cache/syntorch; the file is cpu.json."""
    cache = os.environ.get("SYNTORCH_CACHE_DIR")
    if not cache:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "syntorch"
    return Path(cache) / "cpu.json"


def load_hw_config(name_or_path: str) -> HardwareConfig:
    """A preset name (a100-80gb, h100-sxm, h200-sxm, cpu) or a JSON file of HardwareConfig fields."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path == "cpu":
        path = cpu_config_path()
        if not path.is_file():
            raise UserError(f"the cpu preset is not calibrated yet ({path} missing); run `syntorch calibrate`")
        return _load_json(path)
    if name_or_path.endswith(".json") or os.sep in name_or_path:
        return _load_json(Path(name_or_path))
    raise UserError(f"unknown --hw_config {name_or_path!r}; use one of {', '.join([*PRESETS, 'cpu'])} or a .json file")


def _load_json(path: Path) -> HardwareConfig:
    """A file of every field, or `"base": PRESET` and the fields that differ from it (what-if machines:
    `{"base": "h100-sxm", "inter_node_bw_gb_s": 100}`), named after the file unless it gives a name."""
    data = read_json(path, "hw_config")
    if isinstance(data, dict) and "base" in data:
        base = data.pop("base")
        if not isinstance(base, str) or base not in PRESETS:
            raise UserError(f"{path}: base must be one of {', '.join(PRESETS)}, got {base!r}")
        data = {**PRESETS[base].to_dict(), "name": path.stem, **data}
    return config_from_dict(data, source=str(path))


def config_from_dict(data, source: str = "hw_config") -> HardwareConfig:
    """Checks every field (present, known, right type, positive) and builds the config."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a JSON object of hardware fields")
    names = [f.name for f in fields(HardwareConfig)]
    unknown = sorted(set(data) - set(names))
    missing = [f.name for f in fields(HardwareConfig)
               if f.name not in data and f.name != "name" and f.default is MISSING]
    if unknown:
        raise UserError(f"{source}: unknown field(s) {', '.join(unknown)}; expected {', '.join(names)}")
    if missing:
        raise UserError(f"{source}: missing field(s) {', '.join(missing)}")
    peak = data["peak_tflops"]
    if not isinstance(peak, dict) or "float32" not in peak:
        raise UserError(f"{source}: peak_tflops must be an object of dtype -> TFLOP/s with a float32 entry")
    for dtype, value in peak.items():
        _check_number(source, f"peak_tflops.{dtype}", value, allow_zero=False)
    values = {}
    for f in fields(HardwareConfig):
        if f.name in ("name", "peak_tflops") or (f.default is not MISSING and data.get(f.name) is None):
            continue  # an optional figure left out (or null) keeps its default
        may_be_zero = f.name.endswith(("latency_us", "overhead_us"))
        _check_number(source, f.name, data[f.name], allow_zero=may_be_zero, integer=f.type is int)
        if f.name.endswith("efficiency") and data[f.name] > 1:
            raise UserError(f"{source}: {f.name} is a fraction of a peak, in (0, 1]; got {data[f.name]}")
        values[f.name] = data[f.name]
    name = data.get("name", Path(source).stem)
    if not isinstance(name, str):
        raise UserError(f"{source}: name must be a string")
    return HardwareConfig(name=name, peak_tflops={k: float(v) for k, v in peak.items()}, **values)


def _check_number(source, field, value, allow_zero: bool, integer: bool = False):
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise UserError(f"{source}: {field} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value):  # Python's JSON reads NaN and Infinity
        raise UserError(f"{source}: {field} must be a finite number, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise UserError(f"{source}: {field} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def calibrate_cpu(seconds: float = 1.0, matmul_size: int = 1024, copy_mb: int = 256) -> HardwareConfig:
    """Measures this machine: best-of matmul FLOP/s for float32 and bfloat16, and memory bandwidth
    from a large tensor copy (read + write). Each figure gets about `seconds` of repeats."""
    import torch

    peak = {dtype: _matmul_tflops(getattr(torch, dtype), matmul_size, seconds) for dtype in ("float32", "bfloat16")}
    bw = _copy_gb_s(copy_mb, seconds)
    # Ranks on one machine talk through shared memory (gloo): a copy is the link. The inter-node
    # figures assume 10 GbE and a TCP round trip, since a laptop has no fabric to measure. The figures
    # above are what this machine achieved (efficiencies 1); an op's fixed cost is PyTorch's CPU dispatch,
    # ~10 us per aten op (its profiler on small ops), and one core is one "SM".
    return HardwareConfig("cpu", peak, memory_bw_gb_s=bw, memory_gb=_memory_gb(),
                          intra_node_bw_gb_s=bw / 2, intra_node_latency_us=10.0,
                          inter_node_bw_gb_s=1.25, inter_node_latency_us=50.0,
                          devices_per_node=os.cpu_count() or 1, sm_count=os.cpu_count() or 1,
                          gemm_efficiency=1.0, memory_efficiency=1.0, kernel_overhead_us=10.0,
                          intra_node_bus_efficiency=1.0, inter_node_bus_efficiency=1.0, collective_latency_us=50.0)


def save_cpu_config(config: HardwareConfig, path: Path | None = None) -> Path:
    return calibrate_and_save(path, lambda: config)[1]


def calibrate_and_save(path: Path | None = None, measure=calibrate_cpu) -> tuple[HardwareConfig, Path]:
    """`syntorch calibrate`: `measure()` (calibrate_cpu) saved at `path` (default cpu_config_path()). The
    path is taken (a folder there is refused) before the measuring, so a mistake costs no waiting."""
    from syntorch.outdir import atomic_output_file

    path = path or cpu_config_path()
    with atomic_output_file(path) as tmp:
        config = measure()
        tmp.write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    return config, path


def _best_seconds(fn, budget: float) -> float:
    import time

    fn()  # warm-up: thread pools, page faults
    best, start = float("inf"), time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget:
            return best


def _matmul_tflops(dtype, n: int, budget: float) -> float:
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b), budget) / 1e12


def _copy_gb_s(mb: int, budget: float) -> float:
    import torch

    src = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / _best_seconds(lambda: dst.copy_(src), budget) / 1e9


def _memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 1.0
