"""Decoding speed of GPT-2 124M: syntorch against HuggingFace and against the machine's memory-bound floor.

    python bench/infer_speed.py [--batch 1 8] [--reps 3] [--new_tokens 128] [--prompt_tokens 32] [--variants]

The same random weights run in HF `GPT2LMHeadModel` (built from `GPT2Config()`, saved with save_pretrained)
and in syntorch (loaded from that folder), CPU fp32, greedy. Both must produce the same tokens. Batch-1
decoding is memory-bound: each new token streams every weight matrix once, so the floor per token is the
time of one vector-matrix product per weight matrix (LM head included), measured here in the same run.
Runs alternate (syntorch, HF, floor). Other processes on a small machine stretch many steps, so per-step
times are compared at their 10th percentile (the floor's too), which survives that noise; medians and
whole-run rates (prefill included) are printed as well and agree with it on a quiet machine.

With --variants: fp32, bf16 and int8 weight-only decode tokens/s (as `syntorch infer --dtype/--quant` prepares
the model), each beside its own floor: the bytes it streams per step over the bandwidth the fp32 floor measured.

With --symbolic N [N ...] instead: issue 24's serving row, `syntorch infer --device meta` of Llama-2 7B at batch
60 with 128 prompt tokens and N output tokens, in a fresh process each: wall, CPU seconds (user + system) and
peak RSS of the whole command (`--extra "--hw_config h100-sxm"` adds options; `--syntorch DIR` runs another
checkout).

    python bench/infer_speed.py --symbolic 512 2048 [--extra "..."] [--syntorch DIR]
"""
import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers

from syntorch.checkpoints import load_checkpoint
from syntorch.generate import Sampling, generate, stream_friendly_weights
from syntorch.quant import quantize_int8_weight_only


VARIANTS = {"fp32": (torch.float32, False), "bf16": (torch.bfloat16, False), "int8 w/o": (torch.float32, True)}


def build_pair(folder):
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    hf.generation_config.eos_token_id = None  # always generate the full count
    hf.generation_config.pad_token_id = 0
    hf.save_pretrained(folder)
    return hf, load_variant(folder, torch.float32, False)


def load_variant(folder, dtype, quant: bool):
    """Our model as `syntorch infer --dtype D [--quant int8_weight_only]` prepares it."""
    _, model = load_checkpoint(folder, dtype=dtype)
    if quant:
        quantize_int8_weight_only(model)
    stream_friendly_weights(model)
    return model


def streamed_bytes(model) -> int:
    """Bytes a decode step must read: every matrix multiplied by (int8 ones with their scales), the head once."""
    return sum(m.weight.numel() * m.weight.element_size() + sum(b.numel() * b.element_size() for b in m.buffers())
               for m in model.modules() if isinstance(m, torch.nn.Linear))


def weight_matrices(model) -> list[torch.Tensor]:
    """Every matrix a decode step multiplies by, as [in, out] (the LM head once even when tied)."""
    return [m.weight.t().contiguous() for m in model.modules() if isinstance(m, torch.nn.Linear)]


def floor_step(weights: list[torch.Tensor], batch: int) -> float:
    """Seconds to stream every weight once: one vector-matrix product per matrix, [batch, in] @ [in, out]."""
    inputs = {n: torch.randn(batch, n) for n in {w.shape[0] for w in weights}}
    begin = time.perf_counter()
    for w in weights:
        inputs[w.shape[0]] @ w
    return time.perf_counter() - begin


class StepClock(transformers.StoppingCriteria):
    """HF calls its stopping criteria once per generated token: the gaps between calls are its steps."""

    def __init__(self):
        self.stamps = [time.perf_counter()]

    def __call__(self, input_ids, scores, **kwargs):
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def decode_steps(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps[1:], self.stamps[2:])]  # the first gap is the prefill


def run_syntorch(model, prompt, new_tokens):
    begin = time.perf_counter()
    result = generate(model, prompt, new_tokens, Sampling(temperature=0))
    return time.perf_counter() - begin, result.new_tokens, result.decode_s


def run_hf(hf, prompt, new_tokens):
    clock = StepClock()
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False,
                      stopping_criteria=transformers.StoppingCriteriaList([clock]))
    return time.perf_counter() - clock.stamps[0], out[:, prompt.shape[1]:].tolist(), clock.decode_steps()


def percentile(xs, q):
    return sorted(xs)[int(q / 100 * (len(xs) - 1))]


def bench(hf, ours, weights, batch, args):
    """Alternates syntorch, HF and the floor `reps` times; keeps each one's best run and all its steps."""
    prompt = torch.randint(0, ours.config.vocab_size, (batch, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(batch))
    total = {"syntorch": float("inf"), "hf": float("inf")}
    steps = {"syntorch": [], "hf": []}
    floors = []
    with torch.inference_mode():
        for _ in range(args.reps):
            for name, run, model in (("syntorch", run_syntorch, ours), ("hf", run_hf, hf)):
                seconds, tokens, step_s = run(model, prompt, args.new_tokens)
                total[name] = min(total[name], seconds)
                steps[name] += step_s
                if name == "syntorch":
                    ours_tokens = tokens
                elif tokens != ours_tokens:
                    raise SystemExit(f"batch {batch}: syntorch and HF generated different tokens")
            floors += [floor_step(weights, batch) for _ in range(args.new_tokens // 8)]
    floor = percentile(floors, 10)
    gb = sum(w.numel() * w.element_size() for w in weights) / floor / 1e9
    rate = {k: batch * args.new_tokens / v for k, v in total.items()}
    best = {k: percentile(v, 10) for k, v in steps.items()}
    print(f"batch {batch}: the same {args.new_tokens} tokens per row from syntorch and HF")
    print(f"  floor      {1e3 * floor:6.1f} ms/step  {batch / floor:7.1f} tokens/s  (every weight streamed once, "
          f"{gb:.1f} GB/s; median {1e3 * percentile(floors, 50):.1f} ms)")
    for name in ("hf", "syntorch"):
        print(f"  {name:9s}  {1e3 * best[name]:6.1f} ms/step  {batch / best[name]:7.1f} tokens/s  "
              f"= {100 * floor / best[name]:3.0f}% of floor (median "
              f"{1e3 * percentile(steps[name], 50):.1f} ms)   whole run with prefill: {rate[name]:6.1f} tokens/s")
    print(f"  syntorch / HF: {best['hf'] / best['syntorch']:.2f}x per decode step, "
          f"{rate['syntorch'] / rate['hf']:.2f}x whole run")
    return floor


def bench_variants(folder, floor_s: float, fp32_bytes: int, batch: int, args) -> None:
    """Decode tokens/s of each VARIANTS entry beside its memory-bandwidth floor: its streamed bytes over the
    bandwidth the fp32 floor measured."""
    bandwidth = fp32_bytes / floor_s
    prompt = torch.randint(0, 50257, (batch, args.prompt_tokens), generator=torch.Generator().manual_seed(batch))
    print(f"batch {batch}: decode by weight format (bandwidth {bandwidth / 1e9:.1f} GB/s from the fp32 floor)")
    for name, (dtype, quant) in VARIANTS.items():
        model = load_variant(folder, dtype, quant)
        steps = []
        with torch.inference_mode():
            for _ in range(args.reps):
                steps += run_syntorch(model, prompt, args.new_tokens)[2]
        step, nbytes = percentile(steps, 10), streamed_bytes(model)
        floor = nbytes / bandwidth
        print(f"  {name:9s} {nbytes / 2**20:6.0f} MB streamed  {batch / step:7.1f} tokens/s  floor {batch / floor:7.1f} "
              f"tokens/s  = {100 * floor / step:3.0f}% of its floor")


SYMBOLIC = ["infer", "--model", "llama-2-7b", "--device", "meta", "--batch_size", "60", "--num_input_tokens", "128"]


def bench_symbolic(args) -> None:
    from pp_infer_scale import fresh_syntorch
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.symbolic:
            cost = fresh_syntorch([*SYMBOLIC, "--num_output_tokens", str(n), *args.extra.split()], Path(tmp) / str(n),
                                  args.syntorch)
            print(f"Llama-2 7B on meta, batch 60, 128 + {n} tokens {args.extra}: {cost['wall_s']:.1f} s wall, "
                  f"{cost['cpu_s']:.1f} CPU s, peak RSS {cost['rss_mb']:.0f} MB", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--prompt_tokens", type=int, default=32)
    parser.add_argument("--variants", action="store_true", help="also fp32, bf16 and int8 weight-only vs their floors")
    parser.add_argument("--symbolic", type=int, nargs="+", help="output token counts of the symbolic Llama-2 7B run")
    parser.add_argument("--extra", default="", help="with --symbolic: more `syntorch infer` options")
    parser.add_argument("--syntorch", help="with --symbolic: the syntorch checkout to run (default: this one)")
    args = parser.parse_args()
    if args.symbolic:
        return bench_symbolic(args)
    with tempfile.TemporaryDirectory() as folder:
        hf, ours = build_pair(folder)
        weights = weight_matrices(ours)
        print(f"GPT-2 124M, CPU fp32, {torch.get_num_threads()} threads, {args.prompt_tokens} prompt tokens, "
              f"{args.new_tokens} new tokens, greedy, best of {args.reps}")
        for batch in args.batch:
            floor = bench(hf, ours, weights, batch, args)
            if args.variants:
                bench_variants(folder, floor, streamed_bytes(ours), batch, args)


if __name__ == "__main__":
    main()
