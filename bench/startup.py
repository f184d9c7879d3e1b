"""Start-up cost of a short symbolic run (issue 24): the 175B TP8 command with images, Chakra and prediction

    syntorch infer --model gpt3-175b --device meta --tp 8 --num_input_tokens 2048 --num_output_tokens 8
                   --visualize_trace --chakra --hw_config h100-sxm --out DIR

in a fresh process, `--repeat` times: the minimum wall time, CPU seconds (user + system: what wall time would be
on an idle machine) and peak RSS of the child (os.wait4), and which slow imports it made (torch._dynamo,
sympy, matplotlib, protobuf). `--syntorch DIR` times another checkout (e.g. the commit before a change).
sympy (~0.33 s) comes with any run on meta: torch's Python meta kernels call torch._check, whose
torch.fx.experimental.symbolic_shapes imports sympy at its top (torch 2.13); this command draws and
writes Chakra, so matplotlib and protobuf are its own.

    python bench/startup.py [--repeat 3] [--syntorch DIR]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARGS = ["infer", "--model", "gpt3-175b", "--device", "meta", "--tp", "8", "--num_input_tokens", "2048",
        "--num_output_tokens", "8", "--visualize_trace", "--chakra", "--hw_config", "h100-sxm"]
WATCHED = ["torch._dynamo", "sympy", "matplotlib", "google.protobuf"]
# the command as `syntorch` runs it, then the watched modules it imported, as JSON on the last stderr line
CHILD = ("import atexit, json, sys\n"
         f"atexit.register(lambda: print(json.dumps([m for m in {WATCHED!r} if m in sys.modules]), file=sys.stderr))\n"
         "from syntorch.cli import run_main\nsys.argv[0] = 'syntorch'\nrun_main()")


def measure(syntorch_dir: Path) -> dict:
    """One fresh run of the command; its wall and CPU seconds, peak RSS and watched imports."""
    from train_trace_scale import child_env
    env = child_env(syntorch_dir)
    with tempfile.TemporaryDirectory(prefix="startup.") as tmp:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-P", "-c", CHILD, *ARGS, "--out", f"{tmp}/out"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        stderr = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"syntorch {' '.join(ARGS[:3])} ... failed: {stderr.strip()[-500:]}")
    return dict(wall_s=wall, cpu_s=usage.ru_utime + usage.ru_stime, rss_mb=usage.ru_maxrss / 1024,
                imported=json.loads(stderr.strip().splitlines()[-1]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--syntorch", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout to time (default: this one)")
    args = parser.parse_args()
    runs = [measure(args.syntorch.resolve()) for _ in range(args.repeat)]
    best = {k: min(r[k] for r in runs) for k in ("wall_s", "cpu_s", "rss_mb")}
    print(f"{args.syntorch}: wall {best['wall_s']:.2f} s, CPU {best['cpu_s']:.2f} s, peak RSS "
          f"{best['rss_mb']:.0f} MB (minimum of {args.repeat}); imported {', '.join(runs[0]['imported']) or 'none'}")


if __name__ == "__main__":
    main()
