"""The FasterTransformer seed's latency comparison, on this CPU: HuggingFace `generate` against syntorch's ways
of running the same weights.

    python bench/ft_compare.py [--models gpt2 gpt2-medium] [--batch 1 8] [--prompt_tokens 32] [--new_tokens 128]

Random weights of GPT-2 124M and GPT-2-medium size (transformers' GPT2Config, saved with save_pretrained),
greedy, fp32 unless the column says otherwise. Each syntorch column is one `syntorch infer` run
(inference.run_inference, as the CLI runs it: the checkpoint folder, real ranks over gloo where the column has
them); the figure is its mean decode step (run.json's decode_ms_per_token), HF's the mean gap between its
per-token stopping-criteria calls. Printed: ms per decode step (one token for every row of the batch) and
HF's time over the column's (above 1: faster than HF). TP1's tokens must equal HF's.

A column is one line of COLUMNS: InferenceSpec fields for that run. The PP2 column comes with pipeline-parallel
inference (`pp=2`).
"""
import argparse
import tempfile
from pathlib import Path

import torch
import transformers
from infer_speed import run_hf

from syntorch.errors import RankFailed
from syntorch.inference import InferenceSpec, run_inference

COLUMNS = {
    "TP1": {},
    "TP2": {"tp": 2},
    "int8 w/o": {"quant": "int8_weight_only"},
}
SIZES = {"gpt2": {}, "gpt2-medium": {"n_embd": 1024, "n_layer": 24, "n_head": 16}}


def save_random(name: str, folder: Path) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SIZES[name])).eval()
    hf.generation_config.eos_token_id = None  # always generate the full count
    hf.generation_config.pad_token_id = 0
    hf.save_pretrained(folder)
    return hf


def run_syntorch(folder: Path, prompt: list[int], batch: int, new_tokens: int, out: Path, **fields) -> dict:
    spec = InferenceSpec(checkpoint=str(folder), input_ids=prompt, batch_size=batch, num_output_tokens=new_tokens,
                         temperature=0, **fields)
    return run_inference(spec, out, force=True)


def compare(name: str, hf, folder: Path, batch: int, args, work: Path) -> None:
    prompt = torch.randint(0, hf.config.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        _, hf_tokens, hf_steps = run_hf(hf, prompt[None].repeat(batch, 1), args.new_tokens)
    hf_ms = 1e3 * sum(hf_steps) / len(hf_steps)
    cells = [f"HF {hf_ms:7.1f} ms"]
    same = "TP1 not run"
    for column, fields in COLUMNS.items():
        try:
            record = run_syntorch(folder, prompt.tolist(), batch, args.new_tokens, work / "run", **fields)
        except RankFailed as e:  # e.g. ranks that could not start in time on a loaded machine: say so, go on
            cells.append(f"{column} failed ({e})")
            continue
        ms = record["decode_ms_per_token"]
        if column == "TP1":
            ours = [row[args.prompt_tokens:] for row in record["output_ids"]]
            same = "same tokens as HF" if ours == hf_tokens else "TOKENS DIFFER FROM HF"
        cells.append(f"{column} {ms:7.1f} ms ({hf_ms / ms:4.2f}x)")
    print(f"{name:11s} batch {batch}: " + "  ".join(cells) + f"  [{same}]")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt_tokens", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=128)
    args = parser.parse_args()
    print(f"CPU, {torch.get_num_threads()} threads, {args.prompt_tokens} prompt + {args.new_tokens} new tokens, "
          "greedy; ms per decode step (HF time / ours)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            folder = Path(tmp) / name
            hf = save_random(name, folder)
            for batch in args.batch:
                compare(name, hf, folder, batch, args, Path(tmp))


if __name__ == "__main__":
    main()
