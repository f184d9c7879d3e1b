"""GPT-3 175B, TP 8, 2040 prompt tokens + 8 generated (2048 + 8 exceeds the context), on `meta`: Chakra traces for all 8 ranks.

Prints wall time per step (trace, durations, write), peak RSS and the bytes of the 8 .et files: what
`syntorch infer --model gpt3-175b --device meta --tp 8 --num_input_tokens 2048 --num_output_tokens 8
--hw_config h100-sxm --chakra --out runs/g175` does through the library. Goal: < 10 s, < 2 GB.

    python bench/chakra_scale.py [--out DIR] [--level op|module] [--tokens 2040] [--new 8]
    python bench/chakra_scale.py --converter   # bytes against mlc-chakra's converter, GPT-2 forward on CPU
"""
import argparse
import resource
import tempfile
import time
from pathlib import Path

import torch

from syntorch.config import get_config
from syntorch.chakra.writer import write_chakra
from syntorch.hardware import load_hw_config
from syntorch.trace.generation import trace_tp_symbolic
from syntorch.simulate.prediction import predict_inference
from syntorch.trace.cost import fill_rank_durations
from syntorch.chakra.validator import check_traces


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class Clock:
    """Wall and CPU seconds per step: on a shared machine the CPU figure is the one that does not
    depend on what else runs."""

    def __init__(self):
        self.start = self.last = (time.perf_counter(), time.process_time())

    def lap(self) -> str:
        now, last = (time.perf_counter(), time.process_time()), self.last
        self.last = now
        return f"{now[0] - last[0]:6.2f} s wall, {now[1] - last[1]:6.2f} s CPU"

    def total(self) -> str:
        return f"{self.last[0] - self.start[0]:6.2f} s wall, {self.last[1] - self.start[1]:6.2f} s CPU"


def compare_with_converter(out: Path) -> None:
    """The same GPT-2 forward (seq 64, CPU) captured with the profiler and converted by mlc-chakra (through
    syntorch.capture), and traced by syntorch: nodes and bytes of each .et."""
    from syntorch.capture.to_chakra import convert_rank
    from syntorch.capture.profile import Schedule, TraceFiles, make_profiler
    from syntorch.models import build_model
    from syntorch.trace.tracer import Tracer

    model = build_model(get_config("gpt2"), device="cpu", dtype=torch.float32)
    x = torch.zeros(1, 64, dtype=torch.long)
    files, schedule = TraceFiles(out, "gpt2", 0), Schedule(wait=0, warmup=1, active=1)
    with torch.inference_mode(), make_profiler(files, schedule, "cpu") as prof:
        for _ in range(schedule.steps):
            model(x)
            prof.step()
    theirs = convert_rank(files.host, files.device, 0, files.et)
    with torch.inference_mode(), Tracer(model, meta={"model": "gpt2"}) as tracer:
        model(x)
    ours = write_chakra({0: tracer.graph}, out / "syntorch")
    for who, nodes, size in (("mlc-chakra converter", theirs["nodes"], files.et.stat().st_size),
                             ("syntorch", ours["nodes"], ours["et_bytes"])):
        print(f"{who:21s} {nodes:6d} nodes {size / 1e3:8.1f} kB  ({size / nodes:.0f} B/node)")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt3-175b")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2040)  # 2048 + 8 exceeds the 2048 context
    p.add_argument("--new", type=int, default=8)
    p.add_argument("--level", default="op")
    p.add_argument("--out", help="output folder (default: a temporary one)")
    p.add_argument("--converter", action="store_true", help="compare sizes with mlc-chakra's converter instead")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="chakra_scale.")) / "chakra"
    if args.converter:
        out.parent.mkdir(parents=True, exist_ok=True)
        return compare_with_converter(out.parent)

    clock = Clock()
    ranks = trace_tp_symbolic(get_config(args.model), torch.zeros(1, args.tokens, dtype=torch.long), args.new,
                              args.tp, dtype=torch.bfloat16)
    graph = ranks[0]  # traced here; the other ranks share it
    trace = clock.lap()
    fill_rank_durations(ranks, load_hw_config("h100-sxm"))
    durations = clock.lap()
    summary = write_chakra(ranks, out, level=args.level, force=True)
    write = clock.lap()
    total = clock.total()
    problems, n_ranks, n_nodes = check_traces(out)
    validate = clock.lap()

    ops = sum(1 for _ in graph.ops())
    print(f"{args.model} tp={args.tp} tokens={args.tokens}+{args.new} level={args.level}: "
          f"{ops} ops, {sum(1 for _ in graph.collectives())} collectives per rank")
    print(f"trace        {trace}")
    print(f"durations    {durations}")
    print(f"write chakra {write}  ({summary['ranks']} ranks, {summary['distinct_traces']} encoded, "
          f"{summary['nodes']} nodes per distinct rank)")
    print(f"total        {total}  (goal < 10 s)")
    print(f"peak RSS     {peak_rss_gb():6.2f} GB (goal < 2 GB)")
    print(f".et bytes    {summary['et_bytes'] / 1e6:6.1f} MB for {summary['ranks']} files; "
          f"tensor_trace_chakra.json {(out / 'tensor_trace_chakra.json').stat().st_size / 1e6:.1f} MB")
    print(f"validate     {validate}  ({'ok' if not problems else f'{len(problems)} problems'}: "
          f"{n_ranks} ranks, {n_nodes} nodes)")
    predicted = predict_inference(ranks, "h100-sxm").summary
    print(f"predicted    {predicted['latency_ms']:.1f} ms on h100-sxm (simulated)")
    print(f"written to   {out}")


if __name__ == "__main__":
    main()
