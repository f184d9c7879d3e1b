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

`--fit` refits the four fitted figures of the preset (gemm_efficiency, memory_efficiency, kernel_overhead_us,
collective_latency_us) by Nelder-Mead on the mean of the two tables' MAPEs and prints them; the preset in
syntorch/hardware.py holds the rounded result. Everything else is a datasheet or vendor-benchmark figure.
"""
import argparse
import collections
import csv
import dataclasses
import time
from pathlib import Path

import torch

from syntorch.config import ModelConfig
from syntorch.generate import Sampling
from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.trace import cost
from syntorch.trace.generation import trace_tp_rank
from syntorch.trace.training import trace_stage

ROOT = Path(__file__).resolve().parents[1]
PROFILE = "fused"
FITTED = ("gemm_efficiency", "memory_efficiency", "kernel_overhead_us", "collective_latency_us")
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
def phase_kernels(graph, plan) -> dict[str, collections.Counter]:
    """phase -> Counter of the kernels (cost.Kernel) its nodes launch: equal layers collapse into counts."""
    phases = collections.defaultdict(collections.Counter)
    for node, data in graph.node_attrs.items():
        if data["kind"] != "tensor":
            phases[data["phase"]][cost.kernel_of(graph, node, plan)] += 1
    return phases


def ft_step_kernels(batch: int, prompt: int, tp: int) -> dict[str, collections.Counter]:
    """Prefill of `prompt` tokens and the decode step after it, one TP rank's kernels."""
    tokens = torch.zeros(batch, prompt, dtype=torch.long)
    graph, _ = trace_tp_rank(GPT20B, tokens, 2, tp, 0, dtype=torch.float16, sampling=Sampling(top_p=0.9))
    return phase_kernels(graph, cost.kernel_plan(graph, PROFILE))


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


def ft_cases(path: Path) -> list[FTCase]:
    cases, cache = [], {}

    def kernels(batch, prompt, tp):
        if (batch, prompt, tp) not in cache:
            cache[batch, prompt, tp] = ft_step_kernels(batch, prompt, tp)
        return cache[batch, prompt, tp]

    with open(path) as f:
        for row in csv.DictReader(f):
            b, i, o = (int(row[k]) for k in ("batch", "input_len", "output_len"))
            for tp in (1, 2, 4, 8):
                if row[f"tp{tp}_ms"]:
                    cases.append(FTCase(b, i, o, tp, float(row[f"tp{tp}_ms"]), kernels(b, i, tp),
                                        kernels(b, i + o - 2, tp)))
    return cases


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
    fig, ax = plt.subplots(figsize=(6, 6))
    ax.scatter(measured, predicted, s=14)
    low, high = min(measured + predicted) * 0.8, max(measured + predicted) * 1.25
    ax.plot([low, high], [low, high], "k-", lw=0.8, label="predicted = published")
    for f, style in ((1.12, "r--"), (1 / 1.12, "r--")):
        ax.plot([low, high], [low * f, high * f], style, lw=0.6)
    ax.plot([], [], "r--", lw=0.6, label="±12%")
    ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="published (ms)",
           ylabel="predicted (ms)", title=f"{title}\nMAPE {mape(rows):.1f}%")
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
    ft = ft_cases(calibration / "ft_gpt20b_a100.csv")
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
