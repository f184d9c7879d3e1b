"""`syntorch plan` speed (issue 25): layouts predicted per second, wall and CPU seconds and peak RSS of the whole
command in a fresh process (os.wait4: CPU seconds include the worker processes it waited for; peak RSS is the
largest single process), for

    gpt3-175b   GPT-3 175B on 1,024 A100-80GB, 1,536 x 2,048 tokens per step (Brown et al. 2020's batch)
    llama405b   Llama-3.1 405B on 16,384 H100-SXM, 16M tokens per step at seq 8,192 (Dubey et al. 2024)
    llama405b-wide  the same over every ZeRO stage and SP on and off (1,067 layouts; not run by default)

each as a user runs it (`syntorch plan --model gpt3-175b --gpus 1024 --hw_config a100-80gb --global_batch 1536
--seq 2048 --workers 2 --out ...`). Extra options after `--` go to every case (e.g. `-- --tp 8 --pp 8,16` for a
quick look, or `-- --all_recompute --zero 0,1,2,3` for a wider search).

    python bench/plan_speed.py [--cases gpt3-175b,llama405b] [--workers 2] [-- extra syntorch plan options]

Slices of the wide case measure a change in a few minutes (CPU s per layout, --workers 1, plans.json equal
before and after): `--cases llama405b --workers 1 -- --tp 8 --pp 2,4 --zero 3 --sp false` (27 FSDP layouts
recomputing every layer) went from 11.1 to 3.0 when those stages kept five or six layers a run
(layer_probe.kept_per_run) instead of being probed whole. With one MeshFrame per layout (simulate/steps.mesh_frame),
periods found once per layout and _repeat shifting a period's edges, `-- --tp 8 --pp 4,8,16 --virtual_stages 1,2
--zero 1 --sp true` (35 layouts) went from 49.7 to 44.8 CPU s and `-- --tp 8 --pp 4,8,16 --virtual_stages 1 --zero 2
--sp true` (26) from 31.4 to 28.2 (means of two alternated runs; slices of whole probes gained 3-4%): tracing
(training._run_stage) is 60-75% of a slice's CPU seconds, costing durations (fill_durations) 7-10%.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_trace_scale import SYNTORCH, measure  # noqa: E402 (a sibling bench script)

CASES = {
    "gpt3-175b": ["--model", "gpt3-175b", "--gpus", "1024", "--hw_config", "a100-80gb", "--global_batch", "1536",
                  "--seq", "2048"],
    "llama405b": ["--model", "llama-3.1-405b", "--gpus", "16384", "--hw_config", "h100-sxm",
                  "--tokens_per_step", str(16 * 2**20), "--seq", "8192"],
}
# the 1,000 layouts: the default search predicts ~200 (it leaves out layouts recomputing more than they
# need to fit, never faster, and FSDP under a pipeline, m times ZeRO-1's traffic); the wide case adds every
# ZeRO stage (Megatron-Core's --data-parallel-sharding-strategy optim, optim_grads, optim_grads_params) with a
# pipeline too, and --sequence-parallel off as well as on: 1,067 layouts, none recomputing more than it needs
CASES["llama405b-wide"] = [*CASES["llama405b"], "--zero", "0,1,2,3", "--sp", "both"]


def run_case(name: str, workers: int, extra: list[str]) -> dict:
    import syntorch

    out = Path(tempfile.mkdtemp(prefix="plan_speed.")) / "plan"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(syntorch.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    try:
        cmd = [sys.executable, "-P", "-c", SYNTORCH, "plan", *CASES[name], "--workers", str(workers), "--no_progress",
               "--out", str(out), *extra]
        result = measure(cmd, out, env=env)
        record = json.loads((out / "plans.json").read_text())
        result.update(layouts=len(record["layouts"]), probe_sets=record["probe_sets"], enumerated=record["enumerated"],
                      best=record["layouts"][0]["name"], best_step_s=record["layouts"][0]["step_s"])
        return result
    finally:
        shutil.rmtree(out.parent)


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="gpt3-175b,llama405b")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    print(f"{'case':14s} {'layouts':>8s} {'probes':>7s} {'wall s':>8s} {'CPU s':>8s} {'layouts/s':>10s} "
          f"{'CPU s/layout':>12s} {'peak MB':>8s}  best")
    for name in args.cases.split(","):
        r = run_case(name, args.workers, extra)
        print(f"{name:14s} {r['layouts']:8d} {r['probe_sets']:7d} {r['wall_s']:8.1f} {r['cpu_s']:8.1f} "
              f"{r['layouts'] / r['wall_s']:10.2f} {r['cpu_s'] / r['layouts']:12.2f} {r['rss_mb']:8.0f}  "
              f"{r['best']} ({r['best_step_s']:.2f} s)", flush=True)


if __name__ == "__main__":
    main()
