"""The tracer's cost per probe (issues 24 and 25): CPU seconds of `layer_probe.whole_probe` (a stage's short
symbolic training run, every op recorded: what `syntorch trace` and `syntorch plan` spend most of their time in),
for

    llama405b   Llama-3.1 405B TP8 x PP16 (virtual stages 4) x CP2 x DP64, ZeRO-1, SP, seq 8192, stage 1
    gpt3        GPT-3 175B TP8 x PP8 x DP4, ZeRO-1, SP, seq 2048, stage 1

each in a fresh process, `--repeats` times: the first run (meta kernels not yet cached, as a process's first probe)
and the others (as a search's later probes): their fastest and their mean (which carries the cyclic garbage
collections a run of probes sets off), in CPU seconds (time.process_time: what wall time would be on an idle
machine), with the number of graph nodes recorded and the CPU seconds a warm probe spent in the cyclic
garbage collector on average (when it runs, and what it frees, depends on where its counters stand: a probe
that leaves cycles behind sets off a costly pass every few probes, or leaves its garbage to a later full one).

    python bench/probe_speed.py [--cases llama405b,gpt3] [--repeats 4] [--profile FILE]

`--profile FILE`: a cProfile of the repeats after the first, written to FILE (one case).
"""
import argparse
import json
import subprocess
import sys

CASES = {  # name -> (model, TrainPlan options, stage)
    "llama405b": ("llama-3.1-405b", dict(tp=8, pp=16, virtual_stages=4, cp=2, dp=64, zero=1, sp=True,
                                         micro_batch_size=1, microbatches=32, seq=8192,
                                         account_for_embedding=True, account_for_loss=True), 1),
    "gpt3": ("gpt3-175b", dict(tp=8, pp=8, dp=4, zero=1, sp=True, microbatches=8, seq=2048), 1),
}

RUN = r"""
import cProfile, gc, json, sys, time
import torch
from syntorch.config import get_config
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.layer_probe import whole_probe
from syntorch.trace.training import COST_MICROBATCHES

model, options, stage, repeats, profile = json.loads(sys.argv[1])
config, plan = get_config(model), TrainPlan(**options)
seconds, collecting, nodes = [], [], 0
started = []
gc.callbacks.append(lambda phase, info: started.append(time.process_time()) if phase == "start" else
                    collecting.append(time.process_time() - started.pop()))
profiler = cProfile.Profile() if profile else None
for i in range(repeats):
    if profiler and i == 1:
        profiler.enable()
    if i == 1:
        collecting.clear()
    begin = time.process_time()
    nodes = len(whole_probe(config, plan, stage, torch.bfloat16, COST_MICROBATCHES)[0])
    seconds.append(time.process_time() - begin)
if profiler:
    profiler.disable()
    profiler.dump_stats(profile)
print(json.dumps({"seconds": seconds, "nodes": nodes, "gc": sum(collecting)}))
"""


def run_case(name: str, repeats: int, profile: str | None) -> dict:
    model, options, stage = CASES[name]
    out = subprocess.run([sys.executable, "-P", "-c", RUN, json.dumps([model, options, stage, repeats, profile])],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--profile", help="write a cProfile of the repeats after the first here (one case)")
    args = p.parse_args()
    print(f"{'case':10s} {'nodes':>8s} {'first CPU s':>12s} {'best CPU s':>11s} {'mean CPU s':>11s} {'gc s':>6s}  all")
    for name in args.cases.split(","):
        r = run_case(name, max(2, args.repeats), args.profile)
        first, rest = r["seconds"][0], r["seconds"][1:]
        print(f"{name:10s} {r['nodes']:8d} {first:12.2f} {min(rest):11.3f} {sum(rest) / len(rest):11.3f} "
              f"{r['gc'] / len(rest):6.3f}  {' '.join(f'{s:.2f}' for s in r['seconds'])}", flush=True)


if __name__ == "__main__":
    main()
