"""Validation on published A100 training measurements that are NOT in ../shared/calibration (a check, never a fit).

    python bench/validate_published.py [--tables narayanan,korthikanti] [--rows N] [--attention unfused]
                                       [--out bench/out]

Each row runs as `syntorch trace --predict_only --hw_config a100-80gb --profile fused --attention unfused
--dtype fp16` would (through the library: fidelity.predict_train), with the published layout, and prints
predicted vs published figures, the error per row, the MAPE and the worst row (bench/fidelity.py's report).
Attention is the unfused core by default: Megatron-LM 2021/2022 ran its fused scale-mask-softmax between two
batched GEMMs, not a flash kernel, and its attention dropout (0.1, Megatron's default) as a kernel of its own.

1. Narayanan et al. 2021 (SC'21, "Efficient Large-Scale Language Model Training on GPU Clusters Using
   Megatron-LM"), Table 1: weak scaling of GPT 1.7B-1T on 32-3,072 A100s (Selene), sequence 2048, vocabulary
   51,200, mixed precision, full activation recomputation, achieved TFLOP/s per GPU. Shapes, TP, PP, GPUs and
   global batch from the table; micro-batch size and interleaving (--num-layers-per-virtual-pipeline-stage, so
   virtual stages = layers / (PP x that)) from the paper's own run script, Megatron-LM
   examples/sc21/run_table_1.sh. TFLOP/s per GPU is the paper's Eq. 3, F = 96 B s l h^2 (1 + s/6h + V/16lh)
   per iteration (it counts the recomputed forward: hardware-FLOPs-like), over the predicted step and GPUs.
   Rows 1-4 used torch DDP, which overlaps the gradient all-reduce with backward; rows 5-10 Megatron's local
   DDP, which all-reduces after backward (--overlap_grad_reduce false): the software of each run, not a fit.
   Megatron-LM of 2021 all-reduced a TP input gradient after its linear's whole backward and held the compute
   for it (--async_tp_allreduce false); the overlap with the weight gradient came with Korthikanti et al. 2022.
2. Korthikanti et al. 2022 (MLSys'23, "Reducing Activation Recomputation in Large Transformer Models"),
   Table 5: whole-iteration seconds of 22B, 175B, 530B and 1T with full recomputation (no SP) and with
   selective recomputation + sequence parallelism. Layouts from its Table 3 (TP 8; PP 1/8/35/64; global batch
   4/64/280/512, micro-batch 4/1/1/1; DP 1); interleaving (1, 3, 3, 1 virtual stages) as Calculon's validation
   of the same table sets it (calculon-ai/calculon validation/seqsel/tab5/*.json; Isaev et al. SC'23).
"""
import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity import ROOT, predict_train, report  # noqa: E402 (a sibling bench script)

from syntorch.config import ModelConfig  # noqa: E402
from syntorch.errors import UserError  # noqa: E402
from syntorch.hardware import load_hw_config  # noqa: E402
from syntorch.parallel.plans import TrainPlan  # noqa: E402

SEQ, VOCAB = 2048, 51200


@dataclasses.dataclass(frozen=True)
class Row:
    label: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    micro_batch: int
    virtual: int
    published: float  # TFLOP/s per GPU (Narayanan) or seconds per iteration (Korthikanti)
    recompute: str = "full"
    sp: bool = False
    overlap: bool = True  # the gradient all-reduce overlaps backward (torch DDP) or follows it (Megatron's local DDP)
    async_tp: bool = True  # TP's backward all-reduce overlaps the weight gradient (Megatron-LM 2022 on)

    @property
    def config(self) -> ModelConfig:
        return ModelConfig(name=f"gpt-{self.label.split()[0]}", arch="gpt", n_layer=self.layers, d_model=self.hidden,
                           n_head=self.heads, vocab_size=VOCAB, n_positions=SEQ)

    @property
    def plan(self) -> TrainPlan:
        dp = self.gpus // (self.tp * self.pp)
        return TrainPlan(dp=dp, tp=self.tp, pp=self.pp, sp=self.sp, recompute=self.recompute, seq=SEQ,
                         micro_batch_size=self.micro_batch, microbatches=self.batch // (dp * self.micro_batch),
                         virtual_stages=self.virtual, overlap_grad_reduce=self.overlap,
                         async_tp_allreduce=self.async_tp)

    def params(self) -> float:
        """Narayanan et al. Eq. 2: P = 12 l h^2 (1 + 13/12h + (V + s)/12lh)."""
        l, h = self.layers, self.hidden
        return 12 * l * h**2 * (1 + 13 / (12 * h) + (VOCAB + SEQ) / (12 * l * h))

    def iteration_flops(self) -> float:
        """Narayanan et al. Eq. 3 (with activation recomputation): F = 96 B s l h^2 (1 + s/6h + V/16lh)."""
        l, h = self.layers, self.hidden
        return 96 * self.batch * SEQ * l * h**2 * (1 + SEQ / (6 * h) + VOCAB / (16 * l * h))


# Table 1, with run_table_1.sh's MBS and virtual stages (layers / (PP x layers per virtual stage))
NARAYANAN = [
    Row("1.7B 32 GPUs t1 p1", 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137, async_tp=False),
    Row("3.6B 64 GPUs t2 p1", 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138, async_tp=False),
    Row("7.5B 128 GPUs t4 p1", 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142, async_tp=False),
    Row("18.4B 256 GPUs t8 p1", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135, async_tp=False),
    Row("39.1B 512 GPUs t8 p2", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138, overlap=False, async_tp=False),
    Row("76.1B 1024 GPUs t8 p4 v3", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140, overlap=False, async_tp=False),
    Row("145.6B 1536 GPUs t8 p8 v2", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148, overlap=False, async_tp=False),
    Row("310.1B 1920 GPUs t8 p16 v2", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155, overlap=False, async_tp=False),
    Row("529.6B 2520 GPUs t8 p35 v3", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163, overlap=False, async_tp=False),
    Row("1008.0B 3072 GPUs t8 p64", 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163, overlap=False, async_tp=False),
]


def _table5(name: str, full_s: float, selective_s: float, *layout) -> list[Row]:
    """Korthikanti et al. Table 5's two rows of a model: `layout` = heads, hidden, layers, pp, gpus, global batch,
    micro-batch, virtual stages (TP 8, DP 1)."""
    heads, hidden, layers, pp, *rest = layout
    shape = (heads, hidden, layers, 8, pp, *rest)
    return [Row(f"{name} full recompute", *shape, full_s),
            Row(f"{name} selective + SP", *shape, selective_s, recompute="selective", sp=True)]


KORTHIKANTI = [*_table5("22B", 1.42, 1.10, 64, 6144, 48, 1, 8, 4, 4, 1),
               *_table5("175B", 18.13, 13.75, 96, 12288, 96, 8, 64, 64, 1, 3),
               *_table5("530B", 49.05, 37.83, 128, 20480, 105, 35, 280, 280, 1, 3),
               *_table5("1T", 94.42, 71.49, 160, 25600, 128, 64, 512, 512, 1, 1)]

def predict_step(row: Row, hw, attention: str) -> dict:
    return predict_train(row.config, row.plan, hw, torch.float16, attention=attention)


def run(title: str, rows: list[Row], hw, attention: str, out: Path, filename: str, per_gpu_tflops: bool) -> None:
    results = []
    for row in rows:
        begin = time.perf_counter()
        try:
            summary = predict_step(row, hw, attention)
        except UserError as e:
            print(f"refused {row.label}: {e}", flush=True)
            continue
        step = summary["step_s"]
        predicted = row.iteration_flops() / step / row.gpus / 1e12 if per_gpu_tflops else step
        # where the step went, to name what a row that stays off misses
        print(f"  {row.label}: step {step:.3f} s, bubble {summary['bubble_fraction']:.1%}, exposed comm "
              f"{summary['exposed_comm_s'] / step:.1%}, HFU {summary['hfu']:.1%} -> {predicted:.1f} "
              f"({time.perf_counter() - begin:.0f} s)", flush=True)
        results.append((row.label, row.published, predicted))
    report(title, results, out, filename, "TFLOP/s per GPU" if per_gpu_tflops else "s per iteration")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", default="narayanan,korthikanti", help="comma-separated: narayanan, korthikanti")
    p.add_argument("--attention", default="unfused", choices=["flash", "unfused"])
    p.add_argument("--rows", type=int, help="only the first N rows of each table")
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = p.parse_args()
    hw, out = load_hw_config("a100-80gb"), Path(args.out)
    if "narayanan" in args.tables:
        run(f"Narayanan et al. 2021 Table 1, A100, full recompute, {args.attention} attention (TFLOP/s per GPU, Eq. 3)",
            NARAYANAN[:args.rows], hw, args.attention, out, "validate_narayanan2021.png", per_gpu_tflops=True)
    if "korthikanti" in args.tables:
        run(f"Korthikanti et al. 2022 Table 5, A100, {args.attention} attention (s per iteration)",
            KORTHIKANTI[:args.rows], hw, args.attention, out, "validate_korthikanti2022.png", per_gpu_tflops=False)


if __name__ == "__main__":
    main()
