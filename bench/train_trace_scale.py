"""Training-step traces at cluster scale (issues 9 and 16): whole-command wall and CPU time, peak RSS and
bytes of `syntorch trace` (per-rank Chakra files), for

    256x1     GPT-3 175B DP4 x TP8 x PP8, SP, ZeRO-1, 1 micro-batch     (256 ranks)
    256x8     the same, 8 micro-batches                                (256 ranks)
    8192x1    GPT-3 175B DP128 x TP8 x PP8, SP, ZeRO-1, 1 micro-batch   (8192 ranks)
    llama405b Llama-3.1 405B TP8 x CP1 x PP16 x DP128, SP, ZeRO-1, seq 8192  (16,384 ranks)
    llama405b_v  the same with Llama 3's pipeline (paper section 3.3.2): interleaved (V=2), one layer fewer on the
              first and the last stage, 16 micro-batches, full recomputation (issue 23: < 60 s, < 2 GB)
    mixtral   Mixtral-8x22B EP8 x TP2 x PP4 x DP8, ZeRO-1, seq 4096 (EP inside DP, as Megatron-Core: 64 ranks)
    deepseek  DeepSeek-V3 EP64 x PP16 x DP64, ZeRO-1, full recomputation, seq 4096, 16 micro-batches, 61 layers as
              4 + 14 x 4 + 1 (1,024 ranks; issue 23: < 60 s, < 2 GB)

each as the user runs it (`syntorch trace --model gpt3-175b --mode train --dp 4 --tp 8 --pp 8 --sp
--microbatches 1 --micro_batch_size 1 --seq 2048 --zero 1 --hw_config h100-sxm --trace_level module ...`),
in a fresh process: wall time, CPU seconds (user + system: what wall time would be on an idle machine) and
peak RSS are the child's own (os.wait4). The system part (sys s) is mostly creating and filling the rank
files, and varies several-fold with what the disk went through just before (ext4 steps over recently freed
inodes one by one when it allocates one: after other runs' 16,384-file folders were removed, one run's
system time went from 1.5 s to 8 s here); CPU s minus sys s is the steady part. A case whose model or
options this syntorch lacks prints what it needs instead of running. `--stg DIR` (or $STG_DIR) runs the same
cases through the Symbolic Tensor Graph generator beside (bench/stg_compare.py).

    python bench/train_trace_scale.py [--cases 256x1,256x8,...] [--levels module,op] [--validate] [--stg DIR]
"""
import argparse
import compileall
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SYNTORCH = "import sys; from syntorch.cli import run_main; sys.argv[0] = 'syntorch'; run_main()"


@dataclass(frozen=True)
class Case:
    model: str
    dp: int
    tp: int
    pp: int
    seq: int
    microbatches: int = 1
    sp: bool = True
    cp: int = 1
    ep: int = 1
    zero: int = 1
    extra: tuple = ()  # more `syntorch trace` options


CASES = {
    "256x1": Case("gpt3-175b", dp=4, tp=8, pp=8, seq=2048),
    "256x8": Case("gpt3-175b", dp=4, tp=8, pp=8, seq=2048, microbatches=8),
    "8192x1": Case("gpt3-175b", dp=128, tp=8, pp=8, seq=2048),
    "llama405b": Case("llama-3.1-405b", dp=128, tp=8, pp=16, seq=8192, cp=1),
    # issue 24's side-by-side rows with STG: 405B at 256 and 1,024 ranks
    "405b_256": Case("llama-3.1-405b", dp=2, tp=8, pp=16, seq=8192),
    "405b_1024": Case("llama-3.1-405b", dp=8, tp=8, pp=16, seq=8192),
    "llama405b_v": Case("llama-3.1-405b", dp=128, tp=8, pp=16, seq=8192, microbatches=16,
                        extra=("--virtual_stages=2", "--account_for_embedding", "--account_for_loss",
                               "--recompute=full")),
    "mixtral": Case("mixtral-8x22b", dp=8, tp=2, pp=4, seq=4096, ep=8, sp=False),  # SP is not for MoE layers
    "deepseek": Case("deepseek-v3", dp=64, tp=1, pp=16, seq=4096, ep=64, sp=False, microbatches=16,
                     extra=("--first_stage_layers=4", "--last_stage_layers=1", "--recompute=full")),
}


def trace_options() -> set[str]:
    from syntorch.cli import build_parser
    trace = build_parser()._subparsers._group_actions[0].choices["trace"]
    return {s for action in trace._actions for s in action.option_strings}


def missing(case: Case) -> list[str]:
    """What this syntorch lacks to run `case`: its model in the registry, --cp / --ep for degrees above 1."""
    from syntorch.config import REGISTRY
    needs = [] if case.model in REGISTRY else [f"the model {case.model} in syntorch.config.REGISTRY"]
    options = trace_options()
    needs += [f"`syntorch trace --{dim}`" for dim in ("cp", "ep")
              if getattr(case, dim) != 1 and f"--{dim}" not in options]
    return needs


def syntorch_args(case: Case, level: str, out: Path) -> list[str]:
    options = trace_options()
    degrees = [f"--{dim}={getattr(case, dim)}" for dim in ("cp", "ep") if f"--{dim}" in options]
    return ["trace", "--model", case.model, "--mode", "train", f"--dp={case.dp}", f"--tp={case.tp}",
            f"--pp={case.pp}", *degrees, *(["--sp"] if case.sp else []), f"--microbatches={case.microbatches}",
            "--micro_batch_size=1", f"--seq={case.seq}", f"--zero={case.zero}", "--hw_config=h100-sxm",
            f"--trace_level={level}", *case.extra, "--out", str(out), "--no_progress"]


def child_env(syntorch_dir: Path) -> dict:
    """The environment of a measured syntorch run: `syntorch_dir` first on the path, its sources compiled to
    byte code as an installed package's are (pip compiles them; with PYTHONDONTWRITEBYTECODE set, as on the
    machines this ran on, every run would compile syntorch's sources again: ~0.4 s of each measurement)."""
    compileall.compile_dir(syntorch_dir / "syntorch", quiet=1)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(syntorch_dir), os.environ.get("PYTHONPATH", "")])}


def measure(cmd: list[str], out: Path, cwd=None, env=None) -> dict:
    """Runs `cmd` to its end; its wall and CPU seconds, peak RSS, and the .et files it left in `out`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited {proc.returncode}: {stderr.strip()[-500:]}")
    files = [p.stat().st_size for p in out.glob("*.et")]
    return dict(wall_s=wall, cpu_s=usage.ru_utime + usage.ru_stime, sys_s=usage.ru_stime,
                rss_mb=usage.ru_maxrss / 1024, ranks=len(files), rank_kb=max(files, default=0) / 1e3,
                mb=sum(p.stat().st_size for p in out.iterdir() if p.is_file()) / 1e6)


def run_syntorch(case: Case, level: str, validate: bool) -> dict:
    out = Path(tempfile.mkdtemp(prefix="train_trace_scale.")) / "trace"
    try:
        # the child runs the syntorch this bench imported, wherever it is started from (-P: not the cwd's)
        import syntorch
        env = child_env(Path(syntorch.__file__).parents[1])
        result = measure([sys.executable, "-P", "-c", SYNTORCH, *syntorch_args(case, level, out)], out, env=env)
        summary = json.loads((out / "summary.json").read_text())
        result.update(distinct=summary["distinct_rank_traces"], nodes=[s["chakra_nodes"] for s in summary["stages"]])
        if validate:
            from syntorch.chakra.validator import check_traces
            result["problems"] = len(check_traces(out)[0])
        return result
    finally:
        shutil.rmtree(out.parent)


def row(tool: str, name: str, level: str, r: dict) -> str:
    return (f"{name:10} {tool:8} {level:6} {r['ranks']:6} {r['wall_s']:8.2f} {r['cpu_s']:8.2f} {r['sys_s']:6.2f} "
            f"{r['rss_mb']:7.0f} {r['mb']:9.1f} {r['rank_kb']:8.1f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    p.add_argument("--levels", default="module,op")
    p.add_argument("--validate", action="store_true", help="also run syntorch validate on each case (slow at 8192)")
    p.add_argument("--stg", default=os.environ.get("STG_DIR"),
                   help="a checkout of astra-sim/symbolic_tensor_graph: run each case through it too ($STG_DIR)")
    args = p.parse_args()
    from stg_compare import run_stg, stg_missing
    print(f"{'case':10} {'tool':8} {'level':6} {'ranks':>6} {'wall s':>8} {'CPU s':>8} {'sys s':>6} {'RSS MB':>7} "
          f"{'MB':>9} {'rank KB':>8}  (rank KB: largest .et)")
    for name in args.cases.split(","):
        case = CASES[name]
        if needs := missing(case):
            print(f"{name:10} syntorch needs {' and '.join(needs)}", flush=True)
        ours = {}
        for level in [] if needs else args.levels.split(","):
            r = ours[level] = run_syntorch(case, level, args.validate)
            print(row("syntorch", name, level, r) + f"  distinct {r['distinct']}, chakra nodes per stage {r['nodes']}"
                  + (f", validate: {r['problems']} problems" if "problems" in r else ""), flush=True)
        if args.stg is None:
            print(f"{name:10} STG not installed: {stg_missing(None)}", flush=True)
        elif stg_needs := stg_missing(args.stg):
            print(f"{name:10} STG not runnable: {stg_needs}", flush=True)
        else:
            try:
                theirs, base = run_stg(case, args.stg), ours.get("module")
            except RuntimeError as e:
                print(f"{name:10} STG      {e}", flush=True)
                continue
            print(row("STG", name, "STG", theirs) + (f"  STG/syntorch module: {theirs['wall_s'] / base['wall_s']:.1f}x "
                  f"wall, {theirs['cpu_s'] / base['cpu_s']:.1f}x CPU" if base else ""), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
