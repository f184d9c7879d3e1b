"""Fidelity of the performance model against the published measurements in ../shared/calibration.

    python bench/fidelity.py [--tables ft,korthikanti,nemo] [--rows N] [--out bench/out] [--fit]

Every prediction goes the way a user's does: a symbolic trace on meta, the cost model's durations
(trace/cost.py, fused profile) and the one simulator (syntorch/simulate). Per table: every row's published
figure, the prediction and the error; the mean absolute percentage error (MAPE), the worst row and a
predicted-vs-measured PNG in --out. Each table runs with the attention kernel its software ran (--attention):
the two A100 tables are Megatron-LM 2022 and FasterTransformer, whose context attention is the unfused core
(QK^T GEMM, softmax, GEMM over V; the score matrix through memory; in training, Megatron's attention dropout
over it too); NeMo 24.07 runs Transformer Engine's fused (cuDNN flash) attention. That is the software of the
tables, not a fit.

FasterTransformer GPT-20B (ft_gpt20b_a100.csv, A100-80GB): 44 layers, 48 heads x 128, vocabulary 51,200,
FP16, top-p 0.9 sampling; what `syntorch infer --device meta --tp T --hw_config a100-80gb --profile fused
--attention unfused` predicts for a prompt and two output tokens (prefill, decode step 0). A run of `output` tokens is the
prefill and output - 1 decode steps; a decode step's time is affine in its position (only attention's KV
reads grow with it), so the steps sum to (output - 1) x the mean of the first and the last, the last
predicted as decode step 0 after a prompt of its length.

Megatron-LM 22B layer (korthikanti2022_table4_22b_layer.csv, A100-80GB): hidden 6144, 64 heads, sequence
2048, micro-batch 4, TP 8, FP16; the training step `syntorch trace` probes for a one-layer model of that
shape, and the simulator's time for the layer's forward ops and for its backward ops, each on their own
(Megatron's TP all-reduce of an input gradient overlaps the weight gradient on its own stream).

NeMo 24.07 (nemo2407_h100_fp8.csv, DGX-H100): whole training steps, `syntorch trace --predict_only
--hw_config h100-sxm --dtype fp8 --profile fused --attention flash` (sequence parallel when TP > 1, the
distributed optimizer as ZeRO-1 when DP x CP > 1, no recomputation: the table does not state one, the table's
TP/PP/CP/virtual stages and batches). Shapes: GPT-3 5B and 20B as NeMo's configs give them, 175B as Brown et
al. 2020, all with NeMo's vocabulary of 51,200; Llama 2 and 3 from the registry. Rows whose shape syntorch
lacks (Nemotron: 8B/22B unpublished, 340B's squared-ReLU MLP) or whose plan the memory check refuses are
skipped with the reason printed.

`--fit` refits the four fitted figures of the A100 preset (gemm_efficiency, memory_efficiency,
collective_latency_us, intra_node_latency_us) by Nelder-Mead on the mean of the two A100 tables' MAPEs
(every evaluation re-costs and re-simulates every row: slow) and prints them; the preset in
syntorch/hardware.py holds the rounded result.
"""
import argparse
import csv
import dataclasses
import time
from pathlib import Path

import torch

from syntorch.config import ModelConfig, get_config
from syntorch.errors import UserError
from syntorch.generate import Sampling, generate
from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.simulate.engine import simulate
from syntorch.simulate.graphs import MeshFrame, graph_program
from syntorch.simulate.prediction import predict_inference, predict_training
from syntorch.trace.cost import fill_durations, fill_rank_durations
from syntorch.trace.generation import trace_tp_run
from syntorch.trace.graph import RankTraces
from syntorch.trace.training import trace_stage
from syntorch.workload import trace_workload

ROOT = Path(__file__).resolve().parents[1]
# ../shared/calibration beside the project (a git worktree of it sits one folder deeper, in wt/), where new
# tables arrive; else the copy kept in bench/calibration, so a clone anywhere checks the same published figures
CALIBRATION = next((p for p in (ROOT.parent / "shared" / "calibration", ROOT.parents[1] / "shared" / "calibration")
                    if p.is_dir()), ROOT / "bench" / "calibration")
PROFILE = "fused"
A100_ATTENTION = "unfused"  # Megatron-LM 2022 and FasterTransformer's context attention (module docstring)
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


# --- the paths users run --------------------------------------------------------------------------
def trace_inference(config: ModelConfig, batch: int, prompt: int, tp: int, dtype=torch.float16) -> RankTraces:
    """`syntorch infer --device meta --tp tp`'s graphs for a prompt and two output tokens (top-p 0.9)."""
    tokens = torch.zeros(batch, prompt, dtype=torch.long, device="meta")
    graph, _ = trace_tp_run(config, lambda m, scope: generate(m, tokens, 2, Sampling(top_p=0.9), phase_scope=scope),
                            tp, 0, dtype=dtype)
    ranks = RankTraces(tp)
    ranks.put_shared(range(tp), lambda: graph)
    return ranks


def predict_infer(ranks: RankTraces, hw, profile: str = PROFILE, attention: str = "flash") -> dict:
    """run.json's `predicted` of `syntorch infer --hw_config hw --profile profile --attention attention`."""
    fill_rank_durations(ranks, hw, profile, attention)
    return predict_inference(ranks, hw.name, profile, attention).summary


def predict_train(config: ModelConfig, plan: TrainPlan, hw, dtype=torch.bfloat16, profile: str = PROFILE,
                  attention: str = "flash") -> dict:
    """summary.json's `predicted` of `syntorch trace --predict_only --hw_config hw --profile profile
    --attention attention`."""
    workload = trace_workload(config, plan, dtype, hw, schedule=False, profile=profile, attention=attention)
    return predict_training(workload.probes, workload.source, plan, hw, profile, attention).summary


# --- FasterTransformer GPT-20B ------------------------------------------------------------------------
@dataclasses.dataclass
class FTCase:
    batch: int
    input_len: int
    output_len: int
    tp: int
    measured_ms: float
    first: RankTraces  # the prompt, then decode step 0
    last: RankTraces  # decode step 0 after a prompt as long as the last step's context

    def predict_ms(self, hw) -> float:
        first, last = (predict_infer(ranks, hw, attention=A100_ATTENTION) for ranks in (self.first, self.last))
        mean_step = (first["decode_ms_per_token"] + last["decode_ms_per_token"]) / 2
        return first["prefill_ms"] + (self.output_len - 1) * mean_step


def ft_cases(path: Path, rows: int | None = None) -> list[FTCase]:
    with open(path) as f:
        cells = [(int(row["batch"]), int(row["input_len"]), int(row["output_len"]), tp, float(row[f"tp{tp}_ms"]))
                 for row in csv.DictReader(f) for tp in (1, 2, 4, 8) if row[f"tp{tp}_ms"]]
    cells = cells[:rows] if rows else cells
    traced = {}
    for key in sorted({key for b, i, o, tp, _ in cells for key in ((b, i, tp), (b, i + o - 2, tp))}):
        traced[key] = trace_inference(GPT20B, *key)
    return [FTCase(b, i, o, tp, ms, traced[b, i, tp], traced[b, i + o - 2, tp]) for b, i, o, tp, ms in cells]


# --- Megatron-LM 22B layer --------------------------------------------------------------------------
@dataclasses.dataclass
class LayerCase:
    experiment: str
    measured: tuple[float, float]  # forward, backward ms
    graph: object
    plan: TrainPlan
    forward: list
    backward: list

    def predict_ms(self, hw) -> tuple[float, float]:
        fill_durations(self.graph, hw, PROFILE, A100_ATTENTION)
        frame = MeshFrame(self.plan.mesh)
        return tuple(simulate([graph_program(self.graph, part, frame, nodes=nodes, isolated=True)[0]]).end_us / 1e3
                     for part, nodes in (("forward", self.forward), ("backward", self.backward)))


def layer_cases(path: Path, rows: int | None = None) -> list[LayerCase]:
    cases = []
    with open(path) as f:
        for row in list(csv.DictReader(f))[:rows]:
            sp, recompute = KORTHIKANTI[row["experiment"]]
            plan = TrainPlan(tp=8, sp=sp, recompute=recompute, seq=2048, micro_batch_size=4)
            graph = trace_stage(GPT22B_LAYER, plan, 0, dtype=torch.float16)
            layer = [n for n, d in graph.node_attrs.items() if d["kind"] != "tensor" and d["module"].startswith("layers.0")]
            cases.append(LayerCase(row["experiment"], (float(row["forward_ms"]), float(row["backward_ms"])), graph,
                                   plan, [n for n in layer if graph.node_attrs[n]["phase"] == "forward"],
                                   [n for n in layer if graph.node_attrs[n]["phase"] == "backward"]))
    return cases


# --- NeMo 24.07, DGX-H100 -----------------------------------------------------------------------------
def _gpt3_nemo(name: str, n_layer: int, d_model: int, n_head: int) -> ModelConfig:
    # NeMo's GPT-3 configs (conf/llm/gpt3_*.yaml): FFN 4 x hidden, vocabulary 51,200 (the table's README)
    return ModelConfig(name=name, arch="gpt", n_layer=n_layer, d_model=d_model, n_head=n_head, vocab_size=51200,
                       n_positions=2048)


NEMO_MODELS = {
    "GPT3-5B": _gpt3_nemo("gpt3-5b", 24, 4096, 32),
    "GPT3-20B": _gpt3_nemo("gpt3-20b", 44, 6144, 48),
    "GPT3-175B": _gpt3_nemo("gpt3-175b", 96, 12288, 96),
    "LLAMA2-7B": "llama-2-7b", "LLAMA2-13B": "llama-2-13b", "LLAMA2-70B": "llama-2-70b",
    "LLAMA3-8B": "llama-3-8b", "LLAMA3-70B": "llama-3-70b",
}


@dataclasses.dataclass
class NemoCase:
    label: str
    measured: float  # tokens/s per GPU
    config: ModelConfig
    plan: TrainPlan
    gpus: int

    def predict(self, hw) -> float:
        step_s = predict_train(self.config, self.plan, hw)["step_s"]
        # a step's global batch of sequences, each split over CP ranks
        tokens = self.plan.dp * self.plan.microbatches * self.plan.micro_batch_size * self.plan.seq
        return tokens / step_s / self.gpus


def nemo_cases(path: Path, rows: int | None = None) -> list[NemoCase]:
    cases = []
    with open(path) as f:
        for row in list(csv.DictReader(f))[:rows]:
            gpus, tp, pp, cp = (int(row[k]) for k in ("gpus", "tp", "pp", "cp"))
            label = f"{row['model']} {gpus} GPUs tp{tp} pp{pp} cp{cp} vp{row['vp']}"
            model = NEMO_MODELS.get(row["model"])
            if model is None:
                print(f"skipped {label}: syntorch has no {row['model']} shape (squared-ReLU MLP or config not given)")
                continue
            config = get_config(model) if isinstance(model, str) else model
            dp = gpus // (tp * pp * cp)
            mb, seq = int(row["micro_batch"]), int(row["seq"])
            plan = TrainPlan(dp=dp, tp=tp, pp=pp, cp=cp, sp=tp > 1, zero=1 if dp * cp > 1 else 0, micro_batch_size=mb,
                             seq=seq, microbatches=int(row["global_batch"]) // (dp * mb), virtual_stages=int(row["vp"]),
                             fp8=True)
            cases.append(NemoCase(label, float(row["tokens_per_s_per_gpu"]), dataclasses.replace(config, n_positions=seq),
                                  plan, gpus))
    return cases


def nemo_rows(cases: list[NemoCase], hw) -> list[tuple]:
    rows = []
    for c in cases:
        try:
            rows.append((c.label, c.measured, c.predict(hw)))
        except UserError as e:
            print(f"skipped {c.label}: {e}")
    return rows


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


def report(title: str, rows, out: Path, filename: str, unit: str = "ms") -> None:
    print(f"\n{title}")
    print(f"{'row':62s} {'published':>10s} {'predicted':>10s} {'error':>8s}")
    for label, measured, predicted in rows:
        print(f"{label:62s} {measured:10.1f} {predicted:10.1f} {100 * (predicted - measured) / measured:+7.1f}%")
    kept = scored(rows)
    if not kept:
        print("no rows")
        return
    worst = max(kept, key=lambda r: abs(r[2] - r[1]) / r[1])
    print(f"MAPE {mape(kept):.1f}% over {len(kept)} figures; worst {worst[0]}: "
          f"{100 * (worst[2] - worst[1]) / worst[1]:+.1f}%")
    plot(title, kept, out / filename, unit)


def plot(title: str, rows, path: Path, unit: str) -> None:
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [m for _, m, _ in rows]
    predicted = [p for _, _, p in rows]
    fig, ax = plt.subplots(figsize=(6.5, 6.5))
    groups = sorted({_group(label) for label, _, _ in rows})  # tp1..tp8, forward / backward, models
    for group in groups:
        points = [(m, p) for label, m, p in rows if _group(label) == group]
        ax.scatter(*zip(*points), s=14, label=group)
    low, high = min(measured + predicted) * 0.8, max(measured + predicted) * 1.25
    ax.plot([low, high], [low, high], "k-", lw=0.8, label="predicted = published")
    for f, style in ((1.12, "r--"), (1 / 1.12, "r--")):
        ax.plot([low, high], [low * f, high * f], style, lw=0.6)
    ax.plot([], [], "r--", lw=0.6, label="±12%")
    scale = "log" if high / low > 10 else "linear"  # a narrow range reads better on plain axes
    ax.set(xscale=scale, yscale=scale, xlim=(low, high), ylim=(low, high), xlabel=f"published ({unit})",
           ylabel=f"predicted ({unit})")
    ax.set_title("\n".join(textwrap.wrap(title, 70)) + f"\nMAPE {mape(rows):.1f}%", fontsize=9)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def _group(label: str) -> str:
    """What a row's point is coloured by: its TP degree (FT), forward/backward (layer), model (NeMo)."""
    return label.split()[0] if " GPUs " in label else label.split()[-1]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hw_config", default="a100-80gb", help="for the two A100 tables (NeMo's runs on h100-sxm)")
    p.add_argument("--calibration", default=str(CALIBRATION))
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    p.add_argument("--tables", default="ft,korthikanti,nemo", help="comma-separated: ft, korthikanti, nemo")
    p.add_argument("--rows", type=int, help="only the first N rows (cells) of each table")
    p.add_argument("--fit", action="store_true", help="refit the fitted figures and report with them")
    args = p.parse_args()
    hw, calibration, out, tables = load_hw_config(args.hw_config), Path(args.calibration), Path(args.out), args.tables
    begin = time.perf_counter()
    ft = ft_cases(calibration / "ft_gpt20b_a100.csv", args.rows) if "ft" in tables else []
    layers = layer_cases(calibration / "korthikanti2022_table4_22b_layer.csv", args.rows) if "korthikanti" in tables else []
    print(f"traced {len(ft)} FasterTransformer cells and {len(layers)} Megatron layers in "
          f"{time.perf_counter() - begin:.0f} s")
    if args.fit:
        values, loss = fit(ft, layers, hw)
        print("fitted: " + ", ".join(f"{k}={v:.4g}" for k, v in values.items()) + f" (mean MAPE {loss:.2f}%)")
        hw = dataclasses.replace(hw, **values)
    if ft or layers:
        print(f"hardware {hw.name}: " + ", ".join(f"{k}={getattr(hw, k)}" for k in FITTED))
    ft_rows, layer_rows = errors(ft, layers, hw)
    if ft:
        report("FasterTransformer GPT-20B latency, A100-80GB, fused profile, unfused attention (ms)", ft_rows, out, "fidelity_ft_gpt20b.png")
    if layers:
        report("Megatron-LM 22B one layer, TP8, Korthikanti et al. 2022 Table 4, unfused attention (ms)", layer_rows, out,
               "fidelity_korthikanti_22b.png")
    if "nemo" in tables:
        rows = nemo_rows(nemo_cases(calibration / "nemo2407_h100_fp8.csv", args.rows), load_hw_config("h100-sxm"))
        report("NeMo 24.07 DGX-H100 FP8, fused profile, flash attention (tokens/s/GPU)", rows, out,
               "fidelity_nemo2407_h100.png", "tokens/s/GPU")


if __name__ == "__main__":
    main()
