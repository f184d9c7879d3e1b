"""Symbolic TP generation at scale: GPT-3 175B, TP 8, on meta in one process (issue 5).

Prints wall time and peak RSS for tracing rank 0 (build on meta, shard, prefill + decode under the tracer)
and for deriving the other 7 ranks' graphs, then for writing every rank's Chakra trace. torch's own lazy
imports (torch._dynamo, pulled in by meta init and the dispatch mode) are timed separately: they are paid once
per process whatever is traced.

    python bench/tp_trace_speed.py [--model gpt3-175b] [--tp 8] [--input 2044] [--output 4] [--sp]

The seed's 2048 input tokens + 4 output tokens exceed GPT-3's 2048-position context, so the default prompt
is 2044 tokens (prompt + new tokens = 2048).
"""
import argparse
import resource
import tempfile
import time
from collections import Counter

import torch


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(label: str, fn):
    start = time.perf_counter()
    out = fn()
    print(f"{label:<44} {time.perf_counter() - start:7.2f} s   peak RSS {peak_rss_mb():7.0f} MB")
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt3-175b")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--input", type=int, default=2044)
    p.add_argument("--output", type=int, default=4)
    p.add_argument("--sp", action="store_true")
    args = p.parse_args()

    timed("torch lazy imports (once per process)", lambda: __import__("torch._dynamo"))
    from syntorch.config import get_config
    from syntorch.chakra.writer import write_chakra
    from syntorch.trace.generation import trace_tp_symbolic

    config = get_config(args.model)
    prompt = torch.zeros(1, args.input, dtype=torch.long)
    start = time.perf_counter()
    traces = trace_tp_symbolic(config, prompt, args.output, args.tp, args.sp)
    graph = timed("trace rank 0 (build, shard, generate)", lambda: traces[0])
    timed(f"derive ranks 1..{args.tp - 1}", lambda: [traces[r] for r in range(1, args.tp)])
    label = f"all {args.tp} rank graphs"
    print(f"{label:<44} {time.perf_counter() - start:7.2f} s   (goal < 5 s, < 2048 MB)")
    kinds = Counter(d["collective"] for _, d in graph.collectives())
    print(f"per rank: {len(graph)} nodes, {sum(1 for _ in graph.ops())} ops, collectives {dict(kinds)}")
    with tempfile.TemporaryDirectory() as out:
        summary = timed(f"write Chakra .et for {args.tp} ranks", lambda: write_chakra(traces, out))
    print(f"chakra: {summary['et_bytes'] / 1e6:.1f} MB in {summary['ranks']} files, "
          f"{summary['distinct_traces']} distinct rank trace(s)")


if __name__ == "__main__":
    main()
