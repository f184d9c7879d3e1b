"""Step time of DDP GPT-2-style training with and without the profiler capture (host execution trace +
Kineto + stacks), and the time to link and convert one rank's capture into Chakra.

    python bench/capture_overhead.py [--nproc 2] [--steps 4] [--layers 4] [--d-model 256] [--seq 128] [--batch 4]
"""
import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel


def timed_steps(ddp, optimizer, tokens, steps, profiler=None) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = ddp(tokens)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if profiler is not None:
            profiler.step()
        times.append(time.perf_counter() - start)
    return times


def worker(args, folder):
    from syntorch.capture.to_chakra import convert_rank
    from syntorch.capture.profile import Schedule, TraceFiles, make_profiler
    from syntorch.config import get_config
    from syntorch.models import build_model
    from syntorch.parallel.launch import init_distributed

    rank, world = init_distributed("cpu")
    torch.manual_seed(0)
    config = dataclasses.replace(get_config("gpt2"), n_layer=args.layers, d_model=args.d_model, d_head=0, d_ff=0,
                                 n_head=args.d_model // 64)
    ddp = DistributedDataParallel(build_model(config).train())
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    timed_steps(ddp, optimizer, tokens, 2)  # warm up allocator and DDP's bucket rebuild
    plain = timed_steps(ddp, optimizer, tokens, args.steps)
    files = TraceFiles(Path(folder), "bench", rank)
    with make_profiler(files, Schedule(wait=0, warmup=1, active=args.steps), "cpu") as profiler:
        captured = timed_steps(ddp, optimizer, tokens, args.steps + 1, profiler)[1:]  # active steps only
    start = time.perf_counter()
    result = convert_rank(files.host, files.device, rank, files.et)
    convert_s = time.perf_counter() - start
    if rank == 0:
        params = sum(p.numel() for p in ddp.parameters())
        base, cap = statistics.median(plain), statistics.median(captured)
        print(f"model {args.layers} layers x d_model {args.d_model} ({params / 1e6:.1f}M params), batch {args.batch} "
              f"x seq {args.seq}, {world} ranks (gloo), {torch.get_num_threads()} threads per rank")
        print(f"step time without capture: {base * 1e3:8.1f} ms (median of {args.steps})")
        print(f"step time with capture:    {cap * 1e3:8.1f} ms (median of {args.steps} active profiler steps)")
        print(f"capture overhead ratio:    {cap / base:8.2f}x")
        print(f"link + convert rank 0:     {convert_s:8.1f} s for {args.steps} steps -> {result['nodes']} nodes, "
              f"{result['collectives']} collectives, {files.et.stat().st_size / 1e6:.1f} MB .et")


def main():
    from syntorch.parallel.launch import spawn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="syntorch-bench-") as folder:
        spawn(worker, args.nproc, (args, folder))


if __name__ == "__main__":
    main()
