"""Where published layouts rank in `syntorch plan`'s search over the same GPUs and batch (issue 25, item 4).

1. Narayanan et al. 2021, Table 1 (bench/validate_published.py's rows: GPT 1.7B-1T on 32-3,072 A100s, seq 2048,
   TP/PP/DP, micro-batch and virtual stages of the paper's run script). The search is over the options
   Megatron-LM had in 2021: full recomputation, no SP, no distributed optimizer (--recompute full --sp false
   --zero 0), fp16, unfused attention (as validate_published.py predicts them), and no interleaving on a
   pipeline of two stages (Megatron-LM's README then: "The interleaved schedule is not supported for pipelines
   with 2 stages"; its parallel_state refuses it, "pipeline-model-parallel size should be greater than 2 with
   interleaved schedule"). The published layout is the
   row with its TP, PP, DP, micro-batch size and virtual stages.
2. Llama 3 405B (Dubey et al. 2024, Table 4): 8,192 H100s as TP8 CP1 PP16 DP64 and 16,384 as TP8 CP1 PP16 DP128,
   seq 8,192, 16M tokens per step, bf16, on h100-sxm, the default search space. The table gives the degrees
   only, so the published layout is the best-ranked row with its TP, CP, PP and DP.

A published layout passes when it ranks in the top 5, or a top-5 layout's step is within 3% of its own.

    python bench/plan_published.py [--rows 1,2,3] [--llama 8k,16k] [--workers 2] [--fix tp,cp,vp] [--png DIR]
`--fix`: search only the published TP (CP, virtual stages: 1 for Llama 3, whose table does not give them)
degrees: quicker, and the ranking is then among those layouts.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from validate_published import NARAYANAN, SEQ  # noqa: E402 (a sibling bench script)

from syntorch.config import get_config  # noqa: E402
from syntorch.errors import UserError  # noqa: E402
from syntorch.hardware import load_hw_config  # noqa: E402
from syntorch.plan.report import write_png  # noqa: E402
from syntorch.plan.search import rank, search  # noqa: E402
from syntorch.plan.space import Choices, Work  # noqa: E402

LLAMA = {"8k": (8192, 64), "16k": (16384, 128)}  # GPUs, DP of TP8 CP1 PP16


def rank_of(result, published: dict) -> tuple[dict | None, list[dict]]:
    """The best-ranked row matching every field of `published`, and the top 5."""
    top = result.rows[:5]
    match = next((r for r in result.rows if all(r[k] == v for k, v in published.items())), None)
    return match, top


def verdict(match: dict | None, top: list[dict]) -> str:
    if match is None:
        return "MISS (not among the feasible layouts)"
    if match["rank"] <= 5:
        return "pass"
    near = [r for r in top if abs(r["step_s"] - match["step_s"]) <= 0.03 * match["step_s"]]
    return "pass (within 3% of a top-5)" if near else "MISS"


def report(label: str, result, published: dict, seconds: float, png: Path | None) -> None:
    match, top = rank_of(result, published)
    if png:
        png.mkdir(parents=True, exist_ok=True)
        write_png(result, png / f"plan_{label.split()[0]}_{result.work.gpus}.png")
    best = top[0]
    where = (f"rank {match['rank']:4d} of {len(result.rows):4d}, {match['name']} {match['step_s']:.2f} s "
             f"(+{100 * (match['step_s'] / best['step_s'] - 1):.1f}% on #1)") if match else "not found"
    print(f"{label:30s} {where:75s} #1 {best['name']} {best['step_s']:.2f} s  {verdict(match, top)}  "
          f"[{seconds:.0f} s]", flush=True)


def fixed(fix: list[str], tp: int, cp: int, vp: int) -> dict:
    """Choices fields holding the published degrees named in `fix`."""
    values = {"tp": ("tp", tp), "cp": ("cp", cp), "vp": ("virtual_stages", vp)}
    return {values[name][0]: (values[name][1],) for name in fix}


def narayanan(rows: list[int], hw, workers: int, fix: list[str], png: Path | None) -> None:
    print("Narayanan et al. 2021 Table 1 on a100-80gb (2021 software: full recompute, no SP, DDP, fp16, unfused"
          + (f"; {', '.join(fix)} as published)" if fix else ")"))
    for i in rows:
        row = NARAYANAN[i - 1]
        dp = row.gpus // (row.tp * row.pp)
        choices = Choices(sp=(False,), recompute=("full",), zero=(0,), **fixed(fix, row.tp, 1, row.virtual))
        begin = time.perf_counter()
        try:
            result = search(row.config, Work(row.gpus, row.batch, SEQ), choices, [hw], "fp16", attention="unfused",
                            workers=workers)
        except UserError as e:
            print(f"{row.label:30s} refused: {e}")
            continue
        result.rows = [r for r in result.rows if r["pp"] > 2 or r["vp"] == 1]  # 2021: no interleaving at PP 2
        rank(result)
        report(row.label, result, dict(tp=row.tp, pp=row.pp, dp=dp, mbs=row.micro_batch, vp=row.virtual),
               time.perf_counter() - begin, png)


def llama(which: list[str], workers: int, fix: list[str], png: Path | None) -> None:
    print("Llama 3 405B on h100-sxm, seq 8192, 16M tokens per step (bf16, flash attention, the default search space"
          + (f" with {', '.join(fix)} as published)" if fix else ")"))
    config = get_config("llama-3.1-405b")
    for name in which:
        gpus, dp = LLAMA[name]
        begin = time.perf_counter()
        result = search(config, Work(gpus, 16 * 2**20 // 8192, 8192), Choices(**fixed(fix, 8, 1, 1)),
                        [load_hw_config("h100-sxm")], workers=workers)
        report(f"405B {gpus} GPUs TP8 CP1 PP16 DP{dp}", result, dict(tp=8, cp=1, pp=16, dp=dp),
               time.perf_counter() - begin, png)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,10", help="Narayanan rows (1-10), or empty")
    p.add_argument("--llama", default="8k,16k", help="8k, 16k, or empty")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--fix", default="", help="comma-separated: tp, cp, vp")
    p.add_argument("--png", type=Path, help="folder for each search's plans.png")
    args = p.parse_args()
    fix = [name for name in args.fix.split(",") if name]
    if args.rows:
        narayanan([int(r) for r in args.rows.split(",")], load_hw_config("a100-80gb"), args.workers, fix, args.png)
    if args.llama:
        llama(args.llama.split(","), args.workers, fix, args.png)


if __name__ == "__main__":
    main()
