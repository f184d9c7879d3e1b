"""Peak memory of one rank loading a GPT-2-large-sized checkpoint: unsharded vs its own shard.

    python bench/shard_memory.py [--model gpt2-large] [--keep DIR]

A random GPT-2-large-sized model (774M parameters, 3.1 GB in fp32) is saved once as a HuggingFace folder,
then cut with `syntorch shard` for TP 2 and for PP 2. Each load runs in a fresh spawned process (one per rank,
one at a time) that loads, reads every weight once (as a first forward would) and reports its peak resident
set (VmHWM of /proc/self/status: its copies, and the checkpoint's memory-mapped pages it has read):
- unsharded: the full model, as every rank loaded it before (then kept its TP slice);
- TP 2, rank r from its shard file, and from the HF folder directly (its slices read with get_slice); TP runs
  against a fake 2-rank process group (parallel/comm.symbolic_world): loading needs no peer;
- PP 2, stage s from its shard file: that stage's own load path (its layers, the embedding on the first
  stage, the head on the last).
Goal: each rank's peak at most 60% of the unsharded load's. A process's peak includes the interpreter and
torch (the 'baseline' row, measured the same way), so the ratio is printed with and without it.
"""
import argparse
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import torch

from syntorch.checkpoints import checkpoint_config, load_checkpoint, save_checkpoint
from syntorch.config import get_config
from syntorch.models import build_model
from syntorch.parallel.distributed import symbolic_world
from syntorch.parallel.mesh import Mesh, MeshGroups, init_groups
from syntorch.shard_files import load_rank_model, write_shards


def peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def load(kind: str, folder: str, rank: int, queue) -> None:
    """One measured load in this (fresh) process; puts (peak MB, seconds, weight MB held)."""
    begin = time.perf_counter()
    if kind == "baseline":
        model = None
    elif kind == "unsharded":
        model = load_checkpoint(folder)[1]
    elif kind == "tp2":
        config = checkpoint_config(folder)
        with symbolic_world(rank, 2):
            model = load_rank_model(config, folder, "cpu", torch.float32, init_groups(Mesh(tp=2)))
    else:  # pp2: stage `rank`
        config = checkpoint_config(folder)
        model = load_rank_model(config, folder, "cpu", torch.float32, MeshGroups(Mesh(pp=2), rank))
    tensors = [] if model is None else list({id(t): t for t in model.state_dict().values()}.values())
    for t in tensors:  # touch every weight, as the first forward does: memory-mapped pages count once read
        t.sum()
    held = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    queue.put((peak_mb(), time.perf_counter() - begin, held))


def measure(kind: str, folder, rank: int = 0) -> tuple[float, float, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=load, args=(kind, str(folder), rank, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-large")
    parser.add_argument("--keep", help="folder for the checkpoints (default: a temporary one, removed after)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        hf = root / "hf"
        if not (hf / "model.safetensors").is_file():
            torch.manual_seed(0)
            save_checkpoint(build_model(get_config(args.model)), hf, flag="bench folder")
        for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2)):
            if not (root / name).is_dir():
                write_shards(hf, root / name, tp, pp)
        size = (hf / "model.safetensors").stat().st_size / 2**20
        print(f"{args.model}: {size:.0f} MB checkpoint (fp32); peak RSS of one process per load (VmHWM)")
        base = measure("baseline", hf)[0]
        full = measure("unsharded", hf)
        print(f"  {'baseline (python + torch + syntorch)':38s} {base:7.0f} MB")
        print(f"  {'unsharded load (every rank, before)':38s} {full[0]:7.0f} MB  holds {full[2]:5.0f} MB  "
              f"{full[1]:5.1f} s")
        rows = [(f"TP 2 rank {r}, its shard file", "tp2", root / "tp2", r) for r in range(2)]
        rows += [(f"TP 2 rank {r}, HF folder (get_slice)", "tp2", hf, r) for r in range(2)]
        rows += [(f"PP 2 stage {s}, its shard file", "pp2", root / "pp2", s) for s in range(2)]
        for label, kind, folder, rank in rows:
            peak, seconds, held = measure(kind, folder, rank)
            print(f"  {label:38s} {peak:7.0f} MB  holds {held:5.0f} MB  {seconds:5.1f} s  "
                  f"= {100 * peak / full[0]:3.0f}% of unsharded ({100 * (peak - base) / (full[0] - base):3.0f}% "
                  f"above the baseline)")


if __name__ == "__main__":
    main()
