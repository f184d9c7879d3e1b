"""Tracing speed: the GPT-3 175B symbolic run (wall time, peak RSS) and the tracing overhead on a real
CPU GPT-2 run (traced vs untraced tokens/s). Prints figures; asserts nothing.

    python bench/trace_speed.py [--prompt 2044] [--new 4] [--gpt2_prompt 128] [--gpt2_new 16]

The symbolic run is measured in a fresh process, as a user's `syntorch infer --device meta` would pay it:
import, build on meta, trace (one layer traced, 95 replicated), write the JSON and the PNG.
"""
import argparse
import json
import subprocess
import sys
import time

SYMBOLIC = r"""
import json, resource, sys, tempfile, time
t0 = time.perf_counter()
import torch
from syntorch.config import get_config
from syntorch.export import write_trace_outputs
from syntorch.generate import Sampling
from syntorch.models import build_model
from syntorch.trace import trace_generation
t1 = time.perf_counter()
model = build_model(get_config("gpt3-175b"), device="meta")
t2 = time.perf_counter()
prompt = torch.zeros(1, int(sys.argv[1]), dtype=torch.long, device="meta")
graph, _ = trace_generation(model, prompt, int(sys.argv[2]), Sampling(temperature=0))
t3 = time.perf_counter()
with tempfile.TemporaryDirectory() as out:
    written = write_trace_outputs(graph, out)
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "build_s": t2 - t1, "trace_s": t3 - t2, "write_s": t4 - t3,
                  "nodes": len(graph), "ops": sum(1 for _ in graph.ops()), "png_level": written["tensor_trace_graph.png"],
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))
"""


def symbolic_run(prompt: int, new: int) -> None:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", SYMBOLIC, str(prompt), str(new)], capture_output=True, text=True,
                         check=True)
    wall = time.perf_counter() - start
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"gpt3-175b on meta, {prompt} prompt tokens + {new} new: wall {wall:.2f} s in a fresh process "
          f"(import {r['import_s']:.2f}, build {r['build_s']:.2f}, trace {r['trace_s']:.2f}, "
          f"write json+png {r['write_s']:.2f}); peak RSS {r['peak_rss_gb']:.2f} GB; "
          f"{r['nodes']} nodes, {r['ops']} ops, PNG at {r['png_level']} level")


def overhead(prompt_len: int, new: int, repeats: int = 3) -> None:
    import torch
    from syntorch.config import get_config
    from syntorch.generate import Sampling, generate
    from syntorch.models import build_model
    from syntorch.trace import trace_generation

    torch.manual_seed(0)
    model = build_model(get_config("gpt2"))
    prompt = torch.randint(0, 50257, (1, prompt_len))
    greedy = Sampling(temperature=0)
    generate(model, prompt, 2, greedy)  # warm up

    def best(fn, clock):
        times = []
        for _ in range(repeats):
            begin = clock()
            fn()
            times.append(clock() - begin)
        return min(times)

    runs = {"plain": lambda: generate(model, prompt, new, greedy),
            "traced": lambda: trace_generation(model, prompt, new, greedy)}
    wall = {k: best(fn, time.perf_counter) for k, fn in runs.items()}
    cpu = {k: best(fn, time.process_time) for k, fn in runs.items()}  # less disturbed by other processes
    print(f"gpt2 on cpu, {prompt_len} prompt tokens + {new} new ({torch.get_num_threads()} threads): "
          f"untraced {new / wall['plain']:.1f} tokens/s, traced {new / wall['traced']:.1f} tokens/s, "
          f"overhead {wall['traced'] / wall['plain']:.2f}x wall, {cpu['traced'] / cpu['plain']:.2f}x CPU time "
          f"(best of {repeats})")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=2044, help="175B prompt (its context is 2048 positions)")
    p.add_argument("--new", type=int, default=4)
    p.add_argument("--gpt2_prompt", type=int, default=128)
    p.add_argument("--gpt2_new", type=int, default=16)
    args = p.parse_args()
    symbolic_run(args.prompt, args.new)
    overhead(args.gpt2_prompt, args.gpt2_new)


if __name__ == "__main__":
    main()
