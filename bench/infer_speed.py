"""Decoding speed of GPT-2 124M: syntorch against HuggingFace and against the machine's memory-bound floor.

    python bench/infer_speed.py [--batch 1 8] [--reps 3] [--new_tokens 128] [--prompt_tokens 32]

The same random weights run in HF `GPT2LMHeadModel` (built from `GPT2Config()`, saved with save_pretrained)
and in syntorch (loaded from that folder), CPU fp32, greedy. Both must produce the same tokens. Batch-1
decoding is memory-bound: each new token streams every weight matrix once, so the floor per token is the
time of one vector-matrix product per weight matrix (LM head included), measured here in the same run.
Runs alternate (syntorch, HF, floor) and the best of `--reps` counts, which damps noise from other processes.
"""
import argparse
import tempfile
import time

import torch
import transformers

from syntorch.checkpoints import load_checkpoint
from syntorch.generate import Sampling, generate


def build_pair():
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    hf.generation_config.eos_token_id = None  # always generate the full count
    hf.generation_config.pad_token_id = 0
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        _, ours = load_checkpoint(folder)
    return hf, ours


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


def run_syntorch(model, prompt, new_tokens):
    begin = time.perf_counter()
    result = generate(model, prompt, new_tokens, Sampling(temperature=0))
    return time.perf_counter() - begin, [seq[prompt.shape[1]:] for seq in result.tokens], result


def run_hf(hf, prompt, new_tokens):
    begin = time.perf_counter()
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - begin, out[:, prompt.shape[1]:].tolist()


def bench(hf, ours, weights, batch, args):
    prompt = torch.randint(0, ours.config.vocab_size, (batch, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(batch))
    best = {"syntorch": float("inf"), "hf": float("inf"), "floor": float("inf")}
    with torch.inference_mode():
        for _ in range(args.reps):
            seconds, tokens, result = run_syntorch(ours, prompt, args.new_tokens)
            if seconds < best["syntorch"]:
                best["syntorch"] = seconds
                decode_ms = 1e3 * sum(result.decode_s) / len(result.decode_s)
            seconds, hf_tokens = run_hf(hf, prompt, args.new_tokens)
            best["hf"] = min(best["hf"], seconds)
            best["floor"] = min(min(floor_step(weights, batch) for _ in range(args.new_tokens // 8)), best["floor"])
            if tokens != hf_tokens:
                raise SystemExit(f"batch {batch}: syntorch and HF generated different tokens")
    rate = {k: batch * args.new_tokens / v for k, v in best.items() if k != "floor"}
    floor_rate = batch / best["floor"]
    gb = sum(w.numel() * w.element_size() for w in weights) / best["floor"] / 1e9
    print(f"batch {batch}: same {args.new_tokens} tokens per row from syntorch and HF")
    print(f"  HF        {rate['hf']:7.1f} tokens/s")
    print(f"  syntorch  {rate['syntorch']:7.1f} tokens/s   {rate['syntorch'] / rate['hf']:.2f}x HF   "
          f"(decode {decode_ms:.1f} ms/step, prefill included in tokens/s)")
    print(f"  floor     {floor_rate:7.1f} tokens/s   ({1e3 * best['floor']:.1f} ms per weight stream, {gb:.1f} GB/s)"
          f"   syntorch at {100 * rate['syntorch'] / floor_rate:.0f}% of it, "
          f"decode steps alone at {1e5 * best['floor'] / decode_ms:.0f}%")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--prompt_tokens", type=int, default=32)
    args = parser.parse_args()
    hf, ours = build_pair()
    weights = weight_matrices(ours)
    print(f"GPT-2 124M, CPU fp32, {torch.get_num_threads()} threads, {args.prompt_tokens} prompt tokens, "
          f"{args.new_tokens} new tokens, greedy, best of {args.reps}")
    for batch in args.batch:
        bench(hf, ours, weights, batch, args)


if __name__ == "__main__":
    main()
