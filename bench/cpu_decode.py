"""CPU decode of GPT-2 124M, fp32, batch 1, greedy (issue 24): syntorch against HF `generate` and against the
memory-bandwidth floor, each run as a whole command in a fresh process.

    python bench/cpu_decode.py [--threads 1 2] [--reps 5] [--new_tokens 128] [--prompt_tokens 32] [--compile] [--thp]

The same random weights (HF `GPT2Config()`, saved once) run in five kinds of child process, alternated `reps`
times under the same conditions: syntorch (load_checkpoint, stream_friendly_weights, generate: its decode steps
replayed from a captured graph when the run is long enough to pay for it, syntorch/decode_capture.py), syntorch
with every step eager, HF (`generate`, as bench/infer_speed.py runs it), the floor, and "gemv": a step of only
syntorch's matrix products as its model runs them (its weights, layout and biases), the ceiling of a step made
of these kernels; with --compile a sixth, syntorch under torch.compile. Decoding one row is memory-bound: each
step must read every weight matrix once (the LM head included) and the KV cache written so far. The floor child
times the weights' part as infer_speed does (one vector-matrix product per matrix), which also measures the
bandwidth; the KV part is its bytes over that bandwidth (added to gemv's step, which reads no cache). Per-step
times are compared at their 10th percentile over all reps (other processes stretch many steps on a shared
machine; the low percentile survives that), medians beside them.

A step is the time from one token's step to the next, the loop's own work included (HF's steps are the gaps
between its stopping-criteria calls). Every step is timed twice: in wall time and in the CPU time of the thread
that runs it (time.thread_time). With one thread the CPU time is what wall time would be on a quiet machine;
with more, wall time is the figure, but it needs a quiet machine. Wall, CPU seconds (user + system) and peak
RSS of each whole command are the child's own (os.wait4), the best of the reps.

What separates a captured step from the floor (2026-11-26, one thread, steps of both alternated in one process
on a loaded machine): 2.7-3.2 ms a step. The attention over the cache takes ~1.1 ms more than its bytes at the
floor's bandwidth (the flash kernel reads each head's K and V as separate blocks, ~7 GB/s cold); the LayerNorms,
GELUs, residual adds, cache writes and biases ~1.3 ms (10-25 us each, code and data cold after the weights
streamed past); the tied embedding's lookup in the transposed head ~0.15 ms. A hand-written step of the same
kernels with no glue between them is only ~0.4 ms faster: with these kernels the step stays near 92% of the floor.

The ceiling (2026-11-27, load ~2.5, CPU time, one thread): floor 35.5 ms, gemv 36.8 (95.2% of the floor with
the KV time), syntorch 39.2 (90.6%). gemv's products lose 1.2-1.8 ms to the floor's bare `x @ w` (~0.6 ms of
it F.linear's bias and 3-d row, in one process) and, at two threads, the layers' matrices stream at 23-26 GB/s
against the LM head's ~30: 95% needs faster products, not fewer small ops. Of the ~1.9 ms of glue (each op's
cost measured by removing it from a captured step, alternated in one process): attention ~1.0-1.2 ms, of it
~50 us a call fixed (the flash kernel with one key costs 63 us after an 8 MB stream, 12 us warm; a
bmm/softmax/bmm step costs more, K and V laid out [B, S, H, D] save ~5 us a layer); the LayerNorms ~0.2 ms,
the GELUs ~0.1-0.16 ms; the graph's ~600 view and size nodes nothing measurable (torch.jit's CSE and DCE
passes cut 200 of them and no time). Larger than any of these on this (virtual) host: where the weights land.
In one process, the first of two identically loaded models steps ~2 ms slower at one thread, and a 1.5 GB
tensor touched and freed before loading makes the first the faster one: pages the process has used before
stream faster than fresh ones, so the floor and syntorch children can differ by that much for no reason of
their own. syntorch now keeps its weights on huge pages (stream_friendly_weights), the floor child on 4 kB
pages (--thp moves every child's big tensors to huge pages). That saved a captured step ~0.9 ms at two threads
and ~2.3 ms at one (children with 4 kB and huge pages alternated, 4 pairs each). This bench then, load ~1.2: two
threads floor 16.45 ms, gemv 17.21 (94.3%), syntorch 18.64 (88.3%); one thread floor 31.96, gemv 30.91
(101.9%), syntorch 31.97 (100.0%).
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # infer_speed's functions, imported where a child needs them


def syntorch_child(folder: str, prompt: torch.Tensor, new_tokens: int, compile: bool = False,
                   capture: bool = True) -> dict:
    from syntorch.checkpoints import load_checkpoint
    from syntorch.decode_capture import CapturedForward, capturable
    from syntorch.generate import LocalForward, Sampling, generate, stream_friendly_weights
    _, model = load_checkpoint(folder, dtype=torch.float32)
    stream_friendly_weights(model)
    if compile:  # one graph for every cache length; the first steps pay the compile time
        model.forward = torch.compile(model.forward, dynamic=True)
    # generate() keeps a run with a phase_scope eager (a tracer's hooks must run), so the clock below would turn
    # the capture off: the forward generate() picks without one is passed in
    forward = None
    if capture and capturable(model, prompt.device, new_tokens - 1):
        forward = CapturedForward(prompt.shape[1] + new_tokens, LocalForward())
    stamps = []

    def clock(_phase):  # entered as each step begins: a step is the time to the next one, as HF's StepClock counts
        stamps.append((time.perf_counter(), time.thread_time()))
        return contextlib.nullcontext()

    result = generate(model, prompt, new_tokens, Sampling(temperature=0), phase_scope=clock, forward=forward)
    stamps.append((time.perf_counter(), time.thread_time()))
    wall, cpu = ([b[i] - a[i] for a, b in zip(stamps[1:], stamps[2:])] for i in (0, 1))  # [0] is the prefill
    return {"steps": wall, "cpu_steps": cpu, "tokens": result.new_tokens,
            "first_s": result.prefill_s + sum(result.decode_s[:2])}


def compiled_child(folder: str, prompt: torch.Tensor, new_tokens: int) -> dict:
    return syntorch_child(folder, prompt, new_tokens, compile=True, capture=False)


def eager_child(folder: str, prompt: torch.Tensor, new_tokens: int) -> dict:
    return syntorch_child(folder, prompt, new_tokens, capture=False)


def hf_child(folder: str, prompt: torch.Tensor, new_tokens: int) -> dict:
    import transformers
    from infer_speed import StepClock

    class CpuClock(StepClock):  # the same steps, timed in CPU seconds too
        def __init__(self):
            self.cpu = [time.thread_time()]
            super().__init__()

        def __call__(self, input_ids, scores, **kwargs):
            self.cpu.append(time.thread_time())
            return super().__call__(input_ids, scores, **kwargs)

    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()  # build_pair saved its generation config
    clock = CpuClock()
    with torch.inference_mode():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False,
                          stopping_criteria=transformers.StoppingCriteriaList([clock]))
    return {"steps": clock.decode_steps(), "cpu_steps": [b - a for a, b in zip(clock.cpu[1:], clock.cpu[2:])],
            "tokens": out[:, prompt.shape[1]:].tolist()}


def floor_child(folder: str, prompt: torch.Tensor, new_tokens: int) -> dict:
    """Per step: seconds to stream every weight once, and bytes of K and V the step reads (all layers)."""
    from infer_speed import floor_step, weight_matrices
    from syntorch.checkpoints import load_checkpoint
    _, model = load_checkpoint(folder, dtype=torch.float32)
    c = model.config
    weights = weight_matrices(model)
    del model
    steps, cpu_steps = [], []
    with torch.inference_mode():
        for _ in range(new_tokens):
            begin = time.thread_time()
            steps.append(floor_step(weights, prompt.shape[0]))
            cpu_steps.append(time.thread_time() - begin)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    # decode step i attends over prompt + i + 1 cached positions: K and V, every layer, 4-byte values
    keys = [prompt.shape[1] + i + 1 for i in range(1, new_tokens)]
    kv_bytes = [prompt.shape[0] * 2 * c.n_layer * n * c.d_model * 4 for n in keys]
    return {"steps": steps, "cpu_steps": cpu_steps, "weight_bytes": weight_bytes, "kv_bytes": sum(kv_bytes) / len(kv_bytes)}


def gemv_child(folder: str, prompt: torch.Tensor, new_tokens: int) -> dict:
    """A step of only the matrix products of a syntorch decode step, as its model runs them (the syntorch
    child's weights and layout, biases, a [B, 1, d] row): the most a step of these kernels can reach (the
    floor's products have no bias)."""
    from syntorch.checkpoints import load_checkpoint
    from syntorch.generate import stream_friendly_weights
    _, model = load_checkpoint(folder, dtype=torch.float32)
    stream_friendly_weights(model)
    linears = [(m.weight, m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    rows = {w.shape[1]: torch.randn(prompt.shape[0], 1, w.shape[1]) for w, _ in linears}
    steps, cpu_steps = [], []
    with torch.inference_mode():
        for _ in range(new_tokens - 1):
            begin = time.perf_counter(), time.thread_time()
            for w, b in linears:
                torch.nn.functional.linear(rows[w.shape[1]], w, b)
            steps.append(time.perf_counter() - begin[0])
            cpu_steps.append(time.thread_time() - begin[1])
    return {"steps": steps, "cpu_steps": cpu_steps}


def save_child(folder: str, prompt: torch.Tensor, new_tokens: int) -> dict:
    """The weights every other child loads (in a child: a forked child would count the parent's peak RSS)."""
    from infer_speed import build_pair
    build_pair(folder)
    return {}


CHILDREN = {"syntorch": syntorch_child, "hf": hf_child, "floor": floor_child, "gemv": gemv_child,
            "eager": eager_child, "compiled": compiled_child}


def run_child(kind: str, folder: str, threads: int, args) -> dict:
    """One fresh process; its result with its own wall, CPU seconds and peak RSS (its reaped children's too:
    torch.compile's compile workers)."""
    command = [sys.executable, __file__, "--child", kind, "--folder", folder, "--threads", str(threads),
               "--new_tokens", str(args.new_tokens), "--prompt_tokens", str(args.prompt_tokens)]
    begin = time.perf_counter()
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"} if args.thp else None  # c10: madvise huge pages >= 2 MB
    child = subprocess.Popen(command, stdout=subprocess.PIPE, env=env)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - begin
    if status:
        raise SystemExit(f"the {kind} child failed ({status})")
    result = json.loads(out)
    result.update(wall=wall, cpu=usage.ru_utime + usage.ru_stime, rss_mb=usage.ru_maxrss / 1024)
    return result


def percentile(xs, q):
    return sorted(xs)[int(q / 100 * (len(xs) - 1))]


def per_token(runs: dict, clock: str) -> dict:
    """Each kind's 10th-percentile and median step over all its runs, in `clock` ("steps": wall, "cpu_steps")."""
    steps = {k: [s for r in rs for s in r[clock]] for k, rs in runs.items()}
    return {k: (percentile(v, 10), percentile(v, 50)) for k, v in steps.items()}


def bench(folder: str, threads: int, args) -> None:
    kinds = [k for k in CHILDREN if k != "compiled" or args.compile]
    runs = {kind: [] for kind in kinds}
    timed = [k for k in kinds if k != "floor"]
    for _ in range(args.reps):
        for kind in kinds:
            runs[kind].append(run_child(kind, folder, threads, args))
    if any(r["tokens"] != runs["syntorch"][0]["tokens"] for rs in runs.values() for r in rs if "tokens" in r):
        raise SystemExit(f"{threads} threads: syntorch and HF generated different tokens")
    print(f"{threads} thread(s), the same tokens from syntorch and HF:")
    floors = runs["floor"][0]
    for clock, label in (("steps", "wall"), ("cpu_steps", "CPU")):
        step = per_token(runs, clock)
        weight_s = step["floor"][0]
        bandwidth = floors["weight_bytes"] / weight_s
        floor = weight_s + floors["kv_bytes"] / bandwidth
        print(f"  per step in {label} time: floor {1e3 * floor:.2f} ms/token ({1e3 * weight_s:.2f} weights + "
              f"{1e3 * (floor - weight_s):.2f} KV at {bandwidth / 1e9:.1f} GB/s; median {1e3 * step['floor'][1]:.2f})")
        for kind in timed:
            # the products alone read no cache: the ceiling adds the floor's KV time to them
            kv = floor - weight_s if kind == "gemv" else 0
            print(f"    {kind:8s} {1e3 * step[kind][0]:6.2f} ms/token (median {1e3 * step[kind][1]:6.2f})  "
                  f"{100 * floor / (step[kind][0] + kv):5.1f}% of floor" + (" with the KV time" if kv else ""))
        print(f"    syntorch / HF generate: {step['hf'][0] / step['syntorch'][0]:.2f}x per decode step "
              f"(medians {step['hf'][1] / step['syntorch'][1]:.2f}x)")
    for kind in timed:
        if kind == "gemv":  # a part of a step, not a command
            continue
        best = {k: min(r[k] for r in runs[kind]) for k in ("wall", "cpu", "rss_mb")}
        print(f"  whole command, best of {args.reps}: {kind:8s} wall {best['wall']:5.2f} s  CPU {best['cpu']:5.2f} s  "
              f"peak RSS {best['rss_mb']:4.0f} MB")
    first = {k: min(r["first_s"] for r in runs[k]) for k in kinds if "first_s" in runs[k][0]}
    print(f"  prefill + first two decode steps (wall): {first['syntorch']:.2f} s (captured if the run is long enough, "
          f"decode_capture.py) against {first['eager']:.2f} s eager"
          + (f", {first['compiled']:.1f} s under torch.compile" if args.compile else ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--prompt_tokens", type=int, default=32)
    parser.add_argument("--compile", action="store_true", help="also syntorch under torch.compile: its compile "
                        "time against what it saves")
    parser.add_argument("--thp", action="store_true", help="every child with THP_MEM_ALLOC_ENABLE=1 (torch "
                        "allocates big tensors on transparent huge pages)")
    parser.add_argument("--child", choices=[*CHILDREN, "save"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        torch.set_num_threads(args.threads[0])
        prompt = torch.randint(0, 50257, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(1))
        print(json.dumps({**CHILDREN, "save": save_child}[args.child](args.folder, prompt, args.new_tokens)))
        return
    with tempfile.TemporaryDirectory() as folder:
        run_child("save", folder, 1, args)
        print(f"GPT-2 124M, CPU fp32, batch 1, {args.prompt_tokens} prompt + {args.new_tokens} new tokens, greedy, "
              f"{args.reps} reps per child, load average {os.getloadavg()[0]:.1f}")
        for threads in args.threads:
            bench(folder, threads, args)


if __name__ == "__main__":
    main()
