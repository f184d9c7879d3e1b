"""GPT-3 175B training-step traces at cluster scale (issue 9): wall time, peak RSS and bytes of the per-rank
Chakra files, at module and op level, for

    256 ranks  DP4 x TP8 x PP8, SP, ZeRO-1, 1 micro-batch      (goal < 3 s;  reference generator 25 s, 39 MB)
    256 ranks  DP4 x TP8 x PP8, SP, ZeRO-1, 8 micro-batches    (goal < 8 s;  reference 164 s, 302 MB)
    8192 ranks DP128 x TP8 x PP8, SP, ZeRO-1, 1 micro-batch    (goal < 10 s; reference 186 s, 1.26 GB)

what `syntorch trace --model gpt3-175b --mode train --dp 4 --tp 8 --pp 8 --sp --microbatches 8
--micro_batch_size 1 --seq 2048 --zero 1 --hw_config h100-sxm` does through the library. Each case runs in
a fresh process so its peak RSS is its own.

    python bench/train_trace_scale.py [--cases 256x1,256x8,8192x1] [--levels module,op] [--validate]
"""
import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {"256x1": (4, 1), "256x8": (4, 8), "8192x1": (128, 1)}  # name -> (dp, microbatches)


def run_case(name: str, level: str, validate: bool) -> dict:
    import torch

    from syntorch.config import get_config
    from syntorch.hardware import load_hw_config
    from syntorch.parallel.plans import TrainPlan
    from syntorch.workload import trace_workload, write_workload

    dp, microbatches = CASES[name]
    plan = TrainPlan(dp=dp, tp=8, pp=8, sp=True, zero=1, microbatches=microbatches, seq=2048)
    out = Path(tempfile.mkdtemp(prefix="train_trace_scale.")) / "trace"
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = usage.ru_utime + usage.ru_stime  # CPU seconds: what wall time would be on an idle machine
    t0 = time.perf_counter()
    workload = trace_workload(get_config("gpt3-175b"), plan, torch.bfloat16, load_hw_config("h100-sxm"))
    t1 = time.perf_counter()
    summary = write_workload(workload, out, level, progress=False)
    t2 = time.perf_counter()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result = dict(case=name, level=level, ranks=summary["world_size"], trace_s=t1 - t0, write_s=t2 - t1,
                  total_s=t2 - t0, cpu_s=usage.ru_utime + usage.ru_stime - cpu0, rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  mb=summary["et_bytes"] / 1e6, distinct=summary["distinct_rank_traces"],
                  nodes=[s["chakra_nodes"] for s in summary["stages"]])
    if validate:
        from syntorch.chakra.validate import check_traces
        result["problems"] = len(check_traces(out)[0])
    shutil.rmtree(out.parent)
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--levels", default="module,op")
    p.add_argument("--validate", action="store_true", help="also run syntorch validate on each case (slow at 8192)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # "case:level": run one case in this process, print JSON
    args = p.parse_args()
    if args.one:
        case, level = args.one.split(":")
        print(json.dumps(run_case(case, level, args.validate)))
        return
    print(f"{'case':8} {'level':6} {'ranks':>5} {'trace s':>8} {'write s':>8} {'total s':>8} {'CPU s':>7} {'RSS GB':>7} "
          f"{'MB':>8} {'distinct':>8}  chakra nodes per stage")
    for case in args.cases.split(","):
        for level in args.levels.split(","):
            cmd = [sys.executable, __file__, "--one", f"{case}:{level}"] + (["--validate"] if args.validate else [])
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            print(f"{r['case']:8} {r['level']:6} {r['ranks']:5} {r['trace_s']:8.2f} {r['write_s']:8.2f} "
                  f"{r['total_s']:8.2f} {r['cpu_s']:7.2f} {r['rss_gb']:7.2f} {r['mb']:8.1f} {r['distinct']:8}  {r['nodes']}"
                  + (f"  validate: {r['problems']} problems" if "problems" in r else ""), flush=True)


if __name__ == "__main__":
    main()
