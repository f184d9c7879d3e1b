"""Do two checkouts write the same files? Small symbolic runs (a 4-, an 8- and a 16-layer GPT-2 shape; DP2 x TP2 x
PP2 training at module and op level, with and without durations, and with 8 layers a stage under ZeRO-1 and
SP, and under DDP with small buckets and full recomputation; DP2 x TP2 x PP4 interleaved under the fused
profile; TP2 x PP2 and TP2 inference with Chakra) written by this checkout and by `--base` (a git revision of
this repository, or a folder), then compared file by file, byte for byte. Speed work must leave them equal.
`--scale` adds bench/train_trace_scale.py's 256x8 case (GPT-3 175B DP4 x TP8 x PP8, 8 micro-batches: 256
rank files) at module and op level (~4 runs of 10 s).

    python bench/same_output.py [--base HEAD~1] [--scale]

Not compared byte for byte: syntorch_ranks.json's file fingerprints (they hold modification times), compared
without them.
"""
import argparse
import filecmp
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SHAPE = dict(d_model=64, n_head=4, d_head=16, d_ff=256, vocab_size=128, n_positions=64, name="tiny-gpt2")
TRAIN = ["trace", "--model", "gpt2", "--mode", "train", "--dp", "2", "--tp", "2", "--no_progress"]
INFER = ["infer", "--model", "gpt2", "--device", "meta", "--tp", "2", "--num_input_tokens", "16",
         "--num_output_tokens", "3", "--chakra"]
CASES = {  # name -> (layers, arguments)
    "train_module": (4, [*TRAIN, "--pp", "2", "--sp", "--microbatches", "4", "--seq", "32", "--zero", "1",
                         "--hw_config", "h100-sxm", "--trace_level", "module"]),
    "train_op": (4, [*TRAIN, "--pp", "2", "--sp", "--microbatches", "4", "--seq", "32", "--zero", "1",
                     "--hw_config", "h100-sxm", "--trace_level", "op"]),
    "train_pp4": (8, [*TRAIN, "--pp", "4", "--microbatches", "8", "--virtual_stages", "2", "--hw_config",
                      "a100-80gb", "--profile", "fused", "--trace_level", "module"]),
    "train_nohw": (4, [*TRAIN, "--pp", "2", "--seq", "32", "--zero", "1", "--trace_level", "op"]),
    # 8 layers a stage: more than a layer probe keeps of a run (trace/layer_probe.py)
    "train_deep": (16, [*TRAIN, "--pp", "2", "--sp", "--microbatches", "8", "--seq", "32", "--zero", "1",
                        "--hw_config", "h100-sxm", "--trace_level", "module"]),
    "train_deep_ddp": (16, [*TRAIN, "--pp", "2", "--microbatches", "3", "--seq", "32", "--bucket_mb", "0.01",
                            "--recompute", "full", "--hw_config", "a100-80gb", "--trace_level", "op"]),
    "infer": (4, [*INFER, "--pp", "2", "--batch_size", "2", "--hw_config", "h100-sxm"]),
    "infer_tp": (4, [*INFER, "--trace_level", "op"]),
}
SCALE = ["trace", "--model", "gpt3-175b", "--mode", "train", "--dp=4", "--tp=8", "--pp=8", "--sp", "--microbatches=8",
         "--micro_batch_size=1", "--seq=2048", "--zero=1", "--hw_config=h100-sxm", "--no_progress"]
SCALE_CASES = {f"256x8_{level}": (None, [*SCALE, f"--trace_level={level}"]) for level in ("module", "op")}
SYNTORCH = "import sys; from syntorch.cli import run_main; sys.argv[0] = 'syntorch'; run_main()"


def write_cases(checkout: Path, out: Path, cases: dict) -> None:
    """`cases`: name -> (layers of the tiny shape, or None for the named model as it is; arguments)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    for name, (layers, args) in cases.items():
        shape = out / f"{name}.json"
        if layers:
            shape.write_text(json.dumps({**SHAPE, "n_layer": layers}))
        subprocess.run([sys.executable, "-P", "-c", SYNTORCH, *args,
                        *(["--model_config", str(shape)] if layers else []), "--out", str(out / name)],
                       env=env, check=True, stdout=subprocess.DEVNULL)


def checkout_of(base: str, tmp: Path) -> Path:
    if Path(base).is_dir():
        return Path(base).resolve()
    archive = subprocess.run(["git", "-C", str(HERE), "archive", base], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    return tmp


def differences(a: Path, b: Path) -> list[str]:
    """Files that differ or exist on one side only, below a and b."""
    found = []
    for path in sorted({p.relative_to(a) for p in a.rglob("*")} | {p.relative_to(b) for p in b.rglob("*")}):
        left, right = a / path, b / path
        if left.is_dir() or right.is_dir():
            continue
        if not (left.exists() and right.exists()):
            found.append(f"{path}: only in {'this checkout' if left.exists() else 'the base'}")
        elif path.name == "syntorch_ranks.json":
            sizes = [{**json.loads(p.read_text()), "files": [s for s, _ in json.loads(p.read_text())["files"]]}
                     for p in (left, right)]
            found += [f"{path}: differs"] if sizes[0] != sizes[1] else []
        elif not filecmp.cmp(left, right, shallow=False):
            found.append(f"{path}: differs")
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="a git revision of this repository or a checkout folder")
    parser.add_argument("--scale", action="store_true", help="also the 256-rank 175B case at module and op level")
    args = parser.parse_args()
    cases = {**CASES, **(SCALE_CASES if args.scale else {})}
    with tempfile.TemporaryDirectory(prefix="same_output.") as tmp:
        tmp = Path(tmp)
        for side in ("base", "ours", "src"):
            (tmp / side).mkdir()
        write_cases(checkout_of(args.base, tmp / "src"), tmp / "base", cases)
        write_cases(HERE, tmp / "ours", cases)
        found = differences(tmp / "ours", tmp / "base")
    print("\n".join(found) if found else f"the same files as {args.base}, byte for byte ({len(cases)} runs)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
