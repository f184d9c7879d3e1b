"""How fast `syntorch validate` checks a cluster-scale folder (issue 23, item 3: trace, validate and predict the
DeepSeek-V3 EP64 x PP16 x DP64 layout in under 60 s): CPU seconds and peak RSS of the validation alone, in a
fresh process, with ranks written from one template checked as it (chakra/rank_templates.py) and, with
--whole, every file decoded and checked whole (as before) for comparison.

    python bench/validate_speed.py [--folder DIR] [--ep 8 --pp 16 --dp 8] [--microbatches 16] [--whole]

The folder is traced first (not timed) when it holds no traces: DeepSeek-V3 at seq 4096, full recomputation,
ZeRO 1, module level, no durations (the layout shrunk along DP and EP: per rank the files are the 1,024-rank
layout's but for group ids and peers).

Measured (2026-11-26, 2 shared cores, CPU seconds): bench/train_trace_scale.py's 1,024-rank folder (16 micro-
batches, 3.2 GB): 7.0 s and 0.42 GB (whole: 136.8 s, 5.07 GB); 128 ranks (EP8 x PP16 x DP8): 6.4 s, 0.51 GB
(whole: 34.2 s, 1.27 GB). `syntorch trace` of the 1,024 ranks with --hw_config (probe, predict, write) took
52.4 s and 0.93 GB, so trace, validate and predict take about 59 s.
"""
import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def trace(folder: Path, ep: int, pp: int, dp: int, microbatches: int) -> None:
    from syntorch.cli import main
    assert main(["trace", "--model", "deepseek-v3", "--ep", str(ep), "--pp", str(pp), "--dp", str(dp),
                 "--seq", "4096", "--microbatches", str(microbatches), "--recompute", "full", "--zero", "1",
                 "--no_progress", "--out", str(folder)]) == 0


def validate(folder: Path, whole: bool) -> dict:
    from syntorch.chakra.rank_templates import RankTemplates
    from syntorch.chakra.validator import check_traces

    if whole:
        RankTemplates.match = lambda self, *args: None
    t0, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    problems, ranks, nodes = check_traces(folder)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"ranks": ranks, "nodes": nodes, "problems": len(problems), "seconds": time.perf_counter() - t0,
            "cpu_s": after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime,
            "rss_gb": after.ru_maxrss / 2**20}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--folder", default="/tmp/validate_speed")
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--pp", type=int, default=16)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--whole", action="store_true", help="also check every file whole (rank_templates off)")
    p.add_argument("--run", choices=["templates", "whole"], help=argparse.SUPPRESS)  # one run, in this process
    args = p.parse_args()
    folder = Path(args.folder)
    if args.run:
        print(json.dumps(validate(folder, args.run == "whole")))
        return
    if not any(folder.glob("*.et")):
        trace(folder, args.ep, args.pp, args.dp, args.microbatches)
    for run in ["templates", *(["whole"] if args.whole else [])]:
        out = subprocess.run([sys.executable, __file__, "--folder", str(folder), "--run", run],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{run:9s} {r['ranks']} ranks, {r['nodes']:,} nodes, {r['problems']} problems: {r['cpu_s']:.1f} s CPU "
              f"({r['seconds']:.1f} s wall), peak RSS {r['rss_gb']:.2f} GB")


if __name__ == "__main__":
    main()
