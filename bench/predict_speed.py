"""How fast the simulator predicts at scale (issue 14, item 4): wall time and peak RSS of

    1t      the 1T-parameter layout of Narayanan et al. 2021 (Table 1: 128 layers, hidden 25600, 160 heads),
            TP8 x PP64 = 512 ranks, 512 micro-batches, interleaved (V=2: each stage's two layers as two chunks),
            full recomputation as the paper runs it (else stage 0 needs 145 GB)
            (goal < 30 s, < 2 GB)
    175b    GPT-3 175B TP8 x PP8, 64 micro-batches: four layers of each stage probed (trace/layer_probe.py)
                                                                          (goal < 2 s, issue 24)
    predict `syntorch predict` on the 8,192-rank 175B traces of issue 9 (DP128 x TP8 x PP8, SP, ZeRO-1,
            module level; written first, not timed)                           (goal < 20 s)

each from `syntorch trace --predict_only --hw_config a100-80gb` (probe, cost, simulate, write summary and
timeline) or `syntorch predict`, in a fresh process so its peak RSS is its own. CPU seconds are printed
beside wall time: on a shared machine they are what the wall time would be on an idle one.

    python bench/predict_speed.py [--cases 1t,175b,predict]
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

CASES = ("1t", "175b", "predict")
ONE_T = {"name": "gpt-1t", "base": "gpt3-175b", "n_layer": 128, "d_model": 25600, "n_head": 160,
         "vocab_size": 51200}


def trace_args(case: str, folder: Path) -> list[str]:
    if case == "1t":
        (folder / "1t.json").write_text(json.dumps(ONE_T))
        return ["trace", "--model_config", str(folder / "1t.json"), "--tp", "8", "--pp", "64",
                "--microbatches", "512", "--seq", "2048", "--recompute", "full", *virtual_flag(2)]
    return ["trace", "--model", "gpt3-175b", "--tp", "8", "--pp", "8", "--microbatches", "64", "--seq", "2048"]


def virtual_flag(v: int) -> list[str]:
    """--virtual_stages V when `syntorch trace` has it (the sched helper's interleaved 1F1B)."""
    from syntorch.cli import build_parser
    trace = build_parser()._subparsers._group_actions[0].choices["trace"]
    return ["--virtual_stages", str(v)] if any("--virtual_stages" in a.option_strings for a in trace._actions) else []


def timed(module, name: str, spent: dict) -> None:
    """Count the CPU seconds of module.name (as the CLI calls it) in spent[name]."""
    fn = getattr(module, name)

    def wrapper(*args, **kwargs):
        t0 = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.process_time() - t0
    setattr(module, name, wrapper)


def run_case(case: str) -> dict:
    import syntorch.simulate.chakra_files
    import syntorch.simulate.prediction
    import syntorch.workload
    from syntorch.cli import main

    folder = Path(tempfile.mkdtemp(prefix="predict_speed."))
    try:
        if case == "predict":
            assert main(["trace", "--model", "gpt3-175b", "--dp", "128", "--tp", "8", "--pp", "8", "--sp",
                         "--zero", "1", "--seq", "2048", "--hw_config", "a100-80gb", "--no_progress",
                         "--out", str(folder / "traces")]) == 0
            argv = ["predict", str(folder / "traces"), "--hw_config", "a100-80gb", "--out", str(folder / "out")]
            name = "prediction.json"
        else:
            argv = [*trace_args(case, folder), "--hw_config", "a100-80gb", "--predict_only", "--no_progress",
                    "--out", str(folder / "out")]
            name = "summary.json"
        spent = {}  # CPU seconds: tracing the probes, simulating (from files: reading them too)
        timed(syntorch.workload, "trace_workload", spent)
        timed(syntorch.simulate.prediction, "predict_training", spent)
        timed(syntorch.simulate.chakra_files, "predict_traces", spent)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        rss0, cpu0 = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
        t0 = time.perf_counter()
        assert main(argv) == 0
        seconds = time.perf_counter() - t0
        usage = resource.getrusage(resource.RUSAGE_SELF)
        predicted = json.loads((folder / "out" / name).read_text())["predicted"]
        return {"case": case, "argv": " ".join(argv[:12]), "seconds": seconds,
                "cpu_s": usage.ru_utime + usage.ru_stime - cpu0,  # what wall time would be on an idle machine
                "spent": spent,
                "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "rss_before_gb": rss0 / 2**20,
                "step_s": predicted["step_s"], "mfu": predicted.get("mfu"), "bubble": predicted["bubble_fraction"],
                "virtual_stages": predicted.get("virtual_stages", 1), "notes": predicted.get("notes")}
    finally:
        shutil.rmtree(folder)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this process
    args = p.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    for case in args.cases.split(","):
        out = subprocess.run([sys.executable, __file__, "--case", case], capture_output=True, text=True)
        if out.returncode:
            print(f"{case}: failed\n{out.stderr[-2000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{r['case']:8s} {r['seconds']:6.1f} s wall, {r['cpu_s']:6.1f} s CPU  peak RSS {r['rss_gb']:.2f} GB  predicted step {r['step_s']:.3f} s"
              f"  MFU {r['mfu'] or 0:.1%}  bubble {r['bubble']:.1%}  V={r['virtual_stages']}  ({r['argv']} …)")
        print("         CPU s in " + ", ".join(f"{name} {s:.1f}" for name, s in r["spent"].items()))


if __name__ == "__main__":
    main()
