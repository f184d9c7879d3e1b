"""Symbolic pipeline-parallel generation at scale (issue 15, item 1): `syntorch infer --device meta --tp T --pp P`
for GPT-3 175B at TP 8 x PP 2 and the Megatron-530B layout FasterTransformer benchmarks at TP 8 x PP 3
(its gpt_guide.md: 105 layers, 128 heads x 160, vocab 51200; d_model 20480), in one process each.

Prints wall time and peak RSS of the whole command (trace each stage once, derive the other ranks, write
every rank's Chakra trace), the micro-batches of the prefill and of a decode step (FasterTransformer's rule),
per-rank send/recv/broadcast counts from the traces, and whether `syntorch validate` finds every send met.

    python bench/pp_infer_scale.py [--batch 8] [--input 128] [--output 8] [--only 175b|530b]
"""
import argparse
import dataclasses
import resource
import tempfile
import time
from collections import Counter
from pathlib import Path

from syntorch.chakra.reader import find_traces, read_trace
from syntorch.chakra.validate import check_traces
from syntorch.config import get_config, save_model_config
from syntorch.inference import InferenceSpec, RunOutputs, run_inference
from syntorch.parallel.pipeline_inference import microbatch_rows

# Megatron-530B as FasterTransformer's gpt_guide.md lists it; d_model = 128 x 160
MEGATRON_530B = dict(name="megatron-530b", n_layer=105, d_model=20480, n_head=128, d_head=160, d_ff=4 * 20480,
                     vocab_size=51200, n_positions=2048)
LAYOUTS = {"175b": ("gpt3-175b", None, 8, 2), "530b": ("gpt3-175b", MEGATRON_530B, 8, 3)}


def comm_counts(folder: Path) -> dict[int, Counter]:
    """Per rank, how many send (5), recv (6) and collective (7) nodes its .et holds."""
    names = {5: "send", 6: "recv", 7: "collective"}
    return {rank: Counter(names[n.type] for n in read_trace(path)[1] if n.type in names)
            for rank, path in find_traces(folder)}


def run(label: str, base: str, overrides: dict | None, tp: int, pp: int, args, tmp: Path) -> None:
    config_file = None
    if overrides:
        config_file = tmp / f"{label}.json"
        save_model_config(dataclasses.replace(get_config(base), **overrides), config_file)
    spec = InferenceSpec(model=base, model_config=str(config_file) if config_file else None, device="meta",
                         dtype="fp16", tp=tp, pp=pp, batch_size=args.batch, num_input_tokens=args.input,
                         num_output_tokens=args.output)
    start = time.perf_counter()
    record = run_inference(spec, tmp / label, RunOutputs(chakra=True))
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    prefill, decode = (args.batch // microbatch_rows(args.batch, t, pp) for t in (args.input, 1))
    print(f"{label}: TP {tp} x PP {pp} = {tp * pp} ranks, batch {args.batch}, {args.input} in + {args.output} out: "
          f"{seconds:.1f} s, peak RSS {rss:.0f} MB; {record['trace']['chakra']['nodes']} Chakra nodes")
    print(f"  micro-batches: prefill {prefill}, decode {decode} (FasterTransformer's getLocalBatchSize)")
    counts = comm_counts(tmp / label / "chakra")
    for stage in range(pp):
        c = counts[stage * tp]
        print(f"  stage {stage} (rank {stage * tp}): {c['send']} sends, {c['recv']} recvs, "
              f"{c['collective']} collectives (TP all-reduces/all-gathers, token broadcasts)")
    problems, ranks, nodes = check_traces(tmp / label / "chakra")
    print(f"  validate: {'ok' if not problems else problems[:3]} ({ranks} ranks, {nodes} nodes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input", type=int, default=128)
    parser.add_argument("--output", type=int, default=8)
    parser.add_argument("--only", choices=sorted(LAYOUTS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for label, layout in LAYOUTS.items():
            if args.only in (None, label):
                run(label, *layout, args, Path(tmp))


if __name__ == "__main__":
    main()
