"""Fidelity of the performance model against the published measurements in ../shared/calibration.

    python bench/fidelity.py [--hw_config a100-80gb] [--out bench/out] [--fit]

For every row: the published figure, syntorch's prediction from its own symbolic trace, the error; then the
mean absolute percentage error (MAPE) per table and a predicted-vs-measured PNG per table in --out.

FasterTransformer GPT-20B (ft_gpt20b_a100.csv): 44 layers, 48 heads x 128, vocabulary 51,200, FP16, top-p 0.9
sampling, fused profile, one TP rank's trace on meta (TP ranks are symmetric). FT runs NCCL on the compute
stream, so a rank's time is the serial sum of its kernels and collectives. A run of `output` tokens is the
prefill (which yields the first token) and output - 1 decode steps; a decode step's time is affine in its
position (only attention's KV reads grow with it, memory-bound at every length here), so the steps sum to
(output - 1) x the mean of the first and the last step, each traced as decode step 0 after a prompt of that
length.

Megatron-LM 22B layer (korthikanti2022_table4_22b_layer.csv): hidden 6144, 64 heads, sequence 2048,
micro-batch 4, TP 8, FP16, fused profile; a training step of a one-layer model of that shape, its layer's
forward and backward ops. Forward: serial (every all-reduce feeds the next op). Backward: two streams per
rank (cost.two_stream_us): Megatron launches the TP all-reduce of an input gradient asynchronously and
computes the weight gradient meanwhile, which the trace's dependencies allow and the two streams realise.

`--fit` refits the four fitted figures of the preset (gemm_efficiency, memory_efficiency, collective_latency_us,
intra_node_latency_us) by Nelder-Mead on the mean of the two tables' MAPEs and prints them; the preset in
syntorch/hardware.py holds the rounded result. Everything else is a datasheet or vendor-benchmark figure.
"""
import argparse
import collections
import csv
import dataclasses
import hashlib
import json
import time
from pathlib import Path

import torch

from syntorch.config import ModelConfig
from syntorch.generate import Sampling, generate
from syntorch.hardware import load_hw_config
from syntorch.models import build_model
from syntorch.parallel.comm import symbolic_world
from syntorch.parallel.mesh import Mesh, init_groups
from syntorch.parallel.plans import TrainPlan
from syntorch.parallel.tensor import apply_tp
from syntorch.trace import cost, kernels, tracer
from syntorch.trace.generation import trace_run
from syntorch.trace.training import trace_stage

ROOT = Path(__file__).resolve().parents[1]
PROFILE = "fused"
FITTED = ("gemm_efficiency", "memory_efficiency", "collective_latency_us", "intra_node_latency_us")
GPT20B = ModelConfig(name="gpt-20b", arch="gpt", n_layer=44, d_model=6144, n_head=48, vocab_size=51200,
                     n_positions=2048)
GPT22B_LAYER = ModelConfig(name="gpt-22b-layer", arch="gpt", n_layer=1, d_model=6144, n_head=64, vocab_size=51200,
                           n_positions=2048)
KORTHIKANTI = {  # experiment -> (sequence parallel, recompute)
    "baseline_no_recompute": (False, "none"),
    "sequence_parallel": (True, "none"),
    "full_recompute": (False, "full"),
    "selective_recompute": (False, "selective"),
    "selective_recompute_and_sequence_parallel": (True, "selective"),
}


# --- FasterTransformer GPT-20B ------------------------------------------------------------------------
def phase_kernels(graph, plan, layers: int = 2) -> dict[str, collections.Counter]:
    """phase -> Counter of the kernels (cost.Kernel) its nodes launch, from the trace of a two-layer model
    whose second layer stands for the `layers` - 1 after the first (what replicate.py copies in a full trace;
    the second, not the first, since a layer's first kernel takes in the last add of the layer before)."""
    phases = collections.defaultdict(collections.Counter)
    for node, data in graph.node_attrs.items():
        if data["kind"] != "tensor":
            copies = layers - 1 if data["module"].startswith("layers.1") else 1
            phases[data["phase"]][cost.kernel_of(graph, node, plan)] += copies
    return phases


def ft_kernels(keys: set, cache_path: Path) -> dict:
    """(batch, prompt, tp) -> {phase: Counter of kernels} of the prefill of `prompt` tokens and the decode step
    after it, one TP rank of GPT-20B on meta (two layers traced, the second counted 43 times); one model per TP degree.
    Kept in `cache_path` (JSON) for the next run, valid while the cost model's source is unchanged."""
    version = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (cost, kernels, tracer))).hexdigest()
    cached = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    found = {tuple(json.loads(k)): {phase: collections.Counter({cost.Kernel(*_tuples(kernel)): n for kernel, n in v})
                                    for phase, v in phases.items()}
             for k, phases in cached.get("kernels", {}).items()} if cached.get("version") == version else {}
    for tp in sorted({tp for _, _, tp in keys - set(found)}):
        with symbolic_world(0, tp):
            model = build_model(dataclasses.replace(GPT20B, n_layer=2), device="meta", dtype=torch.float16)
            apply_tp(model, init_groups(Mesh(tp=tp)))
            for batch, prompt, _ in sorted(k for k in keys - set(found) if k[2] == tp):
                tokens = torch.zeros(batch, prompt, dtype=torch.long, device="meta")
                graph, _ = trace_run(model, lambda m, scope: generate(m, tokens, 2, Sampling(top_p=0.9),
                                                                      phase_scope=scope), world_size=tp)
                found[batch, prompt, tp] = phase_kernels(graph, cost.kernel_plan(graph, PROFILE), GPT20B.n_layer)
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    cache_path.write_text(json.dumps({"version": version, "kernels": {
        json.dumps(k): {phase: [[dataclasses.astuple(kernel), n] for kernel, n in counter.items()]
                        for phase, counter in phases.items()} for k, phases in found.items()}}))
    return found


def _tuples(value):
    """JSON lists back into the tuples a Kernel holds (shapes)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


@dataclasses.dataclass
class FTCase:
    batch: int
    input_len: int
    output_len: int
    tp: int
    measured_ms: float
    first: dict  # phase kernels after the prompt (prefill, first decode step)
    last: dict  # phase kernels at the last decode step

    def predict_ms(self, hw) -> float:
        def us(kernels):
            return sum(n * cost.kernel_us(k, hw, PROFILE) for k, n in kernels.items())
        steps = self.output_len - 1
        mean_step = (us(self.first["decode[0]"]) + us(self.last["decode[0]"])) / 2
        return (us(self.first["prefill"]) + steps * mean_step) / 1e3


def ft_cases(path: Path, cache_path: Path) -> list[FTCase]:
    with open(path) as f:
        cells = [(int(row["batch"]), int(row["input_len"]), int(row["output_len"]), tp, float(row[f"tp{tp}_ms"]))
                 for row in csv.DictReader(f) for tp in (1, 2, 4, 8) if row[f"tp{tp}_ms"]]
    found = ft_kernels({key for b, i, o, tp, _ in cells for key in ((b, i, tp), (b, i + o - 2, tp))}, cache_path)
    return [FTCase(b, i, o, tp, ms, found[b, i, tp], found[b, i + o - 2, tp]) for b, i, o, tp, ms in cells]


# --- Megatron-LM 22B layer --------------------------------------------------------------------------
@dataclasses.dataclass
class LayerCase:
    experiment: str
    measured: tuple[float, float]  # forward, backward ms
    graph: object
    forward: list
    backward: list

    def predict_ms(self, hw) -> tuple[float, float]:
        cost.fill_durations(self.graph, hw, PROFILE)
        fwd = sum(self.graph.node_attrs[n]["duration_us"] for n in self.forward)
        return fwd / 1e3, cost.two_stream_us(self.graph, self.backward) / 1e3


def layer_cases(path: Path) -> list[LayerCase]:
    cases = []
    with open(path) as f:
        for row in csv.DictReader(f):
            sp, recompute = KORTHIKANTI[row["experiment"]]
            plan = TrainPlan(tp=8, sp=sp, recompute=recompute, seq=2048, micro_batch_size=4)
            graph = trace_stage(GPT22B_LAYER, plan, 0, dtype=torch.float16)
            layer = [n for n, d in graph.node_attrs.items() if d["kind"] != "tensor" and d["module"].startswith("layers.0")]
            cases.append(LayerCase(row["experiment"], (float(row["forward_ms"]), float(row["backward_ms"])), graph,
                                   [n for n in layer if graph.node_attrs[n]["phase"] == "forward"],
                                   [n for n in layer if graph.node_attrs[n]["phase"] == "backward"]))
    return cases


# --- errors, fit, report ----------------------------------------------------------------------------
def errors(ft, layers, hw) -> tuple[list, list]:
    """(FT rows, layer rows) as (label, measured, predicted) triples."""
    ft_rows = [(f"b{c.batch} in{c.input_len} out{c.output_len} tp{c.tp}", c.measured_ms, c.predict_ms(hw)) for c in ft]
    layer_rows = []
    for c in layers:
        fwd, bwd = c.predict_ms(hw)
        layer_rows += [(f"{c.experiment} forward", c.measured[0], fwd), (f"{c.experiment} backward", c.measured[1], bwd),
                       (f"{c.experiment} combined", sum(c.measured), fwd + bwd)]
    return ft_rows, layer_rows


def mape(rows) -> float:
    return 100 * sum(abs(p - m) / m for _, m, p in rows) / len(rows)


def scored(rows):
    """The rows a table's MAPE is over: the layer table's combined column repeats forward + backward."""
    return [r for r in rows if not r[0].endswith("combined")]


def fit(ft, layers, hw):
    from scipy.optimize import minimize

    def loss(x):
        values = dict(zip(FITTED, x))
        if not (0 < values["gemm_efficiency"] <= 1 and 0 < values["memory_efficiency"] <= 1) or min(x) < 0:
            return 1e9
        ft_rows, layer_rows = errors(ft, layers, dataclasses.replace(hw, **values))
        return (mape(ft_rows) + mape(scored(layer_rows))) / 2

    start = [getattr(hw, name) for name in FITTED]
    result = minimize(loss, start, method="Nelder-Mead", options={"xatol": 1e-3, "fatol": 1e-3, "maxfev": 400})
    return dict(zip(FITTED, result.x)), result.fun


def report(title: str, rows, out: Path, filename: str) -> None:
    print(f"\n{title}")
    print(f"{'row':58s} {'published':>10s} {'predicted':>10s} {'error':>8s}")
    for label, measured, predicted in rows:
        print(f"{label:58s} {measured:10.1f} {predicted:10.1f} {100 * (predicted - measured) / measured:+7.1f}%")
    kept = scored(rows)
    worst = max(kept, key=lambda r: abs(r[2] - r[1]) / r[1])
    print(f"MAPE {mape(kept):.1f}% over {len(kept)} figures; worst {worst[0]}: "
          f"{100 * (worst[2] - worst[1]) / worst[1]:+.1f}%")
    plot(title, kept, out / filename)


def plot(title: str, rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [m for _, m, _ in rows]
    predicted = [p for _, _, p in rows]
    fig, ax = plt.subplots(figsize=(6.5, 6.5))
    groups = sorted({label.split()[-1] for label, _, _ in rows})  # tp1..tp8, or forward / backward
    for group in groups:
        points = [(m, p) for label, m, p in rows if label.split()[-1] == group]
        ax.scatter(*zip(*points), s=14, label=group)
    low, high = min(measured + predicted) * 0.8, max(measured + predicted) * 1.25
    ax.plot([low, high], [low, high], "k-", lw=0.8, label="predicted = published")
    for f, style in ((1.12, "r--"), (1 / 1.12, "r--")):
        ax.plot([low, high], [low * f, high * f], style, lw=0.6)
    ax.plot([], [], "r--", lw=0.6, label="±12%")
    ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="published (ms)",
           ylabel="predicted (ms)")
    ax.set_title(f"{title}\nMAPE {mape(rows):.1f}%", fontsize=9)
    ax.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hw_config", default="a100-80gb")
    p.add_argument("--calibration", default=str(ROOT.parent / "shared" / "calibration"))
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    p.add_argument("--fit", action="store_true", help="refit the fitted figures and report with them")
    args = p.parse_args()
    hw, calibration, out = load_hw_config(args.hw_config), Path(args.calibration), Path(args.out)
    begin = time.perf_counter()
    ft = ft_cases(calibration / "ft_gpt20b_a100.csv", out / "fidelity_ft_kernels.json")
    layers = layer_cases(calibration / "korthikanti2022_table4_22b_layer.csv")
    print(f"traced {len(ft)} FasterTransformer cells and {len(layers)} Megatron layers in "
          f"{time.perf_counter() - begin:.0f} s")
    if args.fit:
        values, loss = fit(ft, layers, hw)
        print("fitted: " + ", ".join(f"{k}={v:.4g}" for k, v in values.items()) + f" (mean MAPE {loss:.2f}%)")
        hw = dataclasses.replace(hw, **values)
    print(f"hardware {hw.name}: " + ", ".join(f"{k}={getattr(hw, k)}" for k in FITTED))
    ft_rows, layer_rows = errors(ft, layers, hw)
    report("FasterTransformer GPT-20B latency, A100-80GB, fused profile (ms)", ft_rows, out, "fidelity_ft_gpt20b.png")
    report("Megatron-LM 22B one layer, TP8, Korthikanti et al. 2022 Table 4 (ms)", layer_rows, out,
           "fidelity_korthikanti_22b.png")


if __name__ == "__main__":
    main()
