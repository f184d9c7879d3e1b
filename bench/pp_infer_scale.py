"""Symbolic pipeline-parallel generation at scale (issue 15, item 1): `syntorch infer --device meta --tp T --pp P`
for GPT-3 175B at TP 8 x PP 2 and the Megatron-530B layout FasterTransformer benchmarks at TP 8 x PP 3
(its gpt_guide.md: 105 layers, 128 heads x 160, vocab 51200; d_model 20480), in one process each.

Prints wall time, CPU seconds (user + system: what wall time would be on an idle machine) and peak RSS of the
whole command (`syntorch infer ... --chakra` in a fresh process: trace each stage once, derive the other
ranks, write every rank's Chakra trace), the micro-batches of the prefill and of a decode step
(FasterTransformer's rule), per-rank send/recv/broadcast counts from the traces, and whether `syntorch
validate` finds every send met. `--syntorch DIR` runs another checkout (e.g. the commit before a change).

    python bench/pp_infer_scale.py [--batch 8] [--input 128] [--output 8] [--only 175b|530b] [--syntorch DIR]
"""
import argparse
import dataclasses
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

from syntorch.chakra.reader import find_traces, read_trace
from syntorch.chakra.validator import check_traces
from syntorch.config import get_config, save_model_config
from syntorch.parallel.pipeline_inference import microbatch_rows
from train_trace_scale import SYNTORCH, measure

# Megatron-530B as FasterTransformer's gpt_guide.md lists it; d_model = 128 x 160
MEGATRON_530B = dict(name="megatron-530b", n_layer=105, d_model=20480, n_head=128, d_head=160, d_ff=4 * 20480,
                     vocab_size=51200, n_positions=2048)
LAYOUTS = {"175b": ("gpt3-175b", None, 8, 2), "530b": ("gpt3-175b", MEGATRON_530B, 8, 3)}


def comm_counts(folder: Path) -> dict[int, Counter]:
    """Per rank, how many send (5), recv (6) and collective (7) nodes its .et holds."""
    names = {5: "send", 6: "recv", 7: "collective"}
    return {rank: Counter(names[n.type] for n in read_trace(path)[1] if n.type in names)
            for rank, path in find_traces(folder)}


def fresh_syntorch(args: list[str], out: Path, syntorch_dir: str | None = None) -> dict:
    """`syntorch ARGS --out OUT` in a fresh process of this syntorch (or the checkout `syntorch_dir`): its wall
    and CPU seconds and peak RSS (train_trace_scale.measure)."""
    import syntorch
    code = syntorch_dir or str(Path(syntorch.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([code, os.environ.get("PYTHONPATH", "")])}
    return measure([sys.executable, "-P", "-c", SYNTORCH, *args, "--out", str(out)], out, env=env)


def run(label: str, base: str, overrides: dict | None, tp: int, pp: int, args, tmp: Path) -> None:
    config = []
    if overrides:
        config = ["--model_config", str(tmp / f"{label}.json")]
        save_model_config(dataclasses.replace(get_config(base), **overrides), tmp / f"{label}.json")
    out = tmp / label
    cost = fresh_syntorch(["infer", "--model", base, *config, "--device", "meta", "--dtype", "fp16", "--tp", str(tp),
                           "--pp", str(pp), "--batch_size", str(args.batch), "--num_input_tokens", str(args.input),
                           "--num_output_tokens", str(args.output), "--chakra"], out, args.syntorch)
    record = json.loads((out / "run.json").read_text())
    prefill, decode = (args.batch // microbatch_rows(args.batch, t, pp) for t in (args.input, 1))
    print(f"{label}: TP {tp} x PP {pp} = {tp * pp} ranks, batch {args.batch}, {args.input} in + {args.output} out: "
          f"{cost['wall_s']:.1f} s wall, {cost['cpu_s']:.1f} CPU s, peak RSS {cost['rss_mb']:.0f} MB; "
          f"{record['trace']['chakra']['nodes']} Chakra nodes")
    print(f"  micro-batches: prefill {prefill}, decode {decode} (FasterTransformer's getLocalBatchSize)")
    counts = comm_counts(out / "chakra")
    for stage in range(pp):
        c = counts[stage * tp]
        print(f"  stage {stage} (rank {stage * tp}): {c['send']} sends, {c['recv']} recvs, "
              f"{c['collective']} collectives (TP all-reduces/all-gathers, token broadcasts)")
    problems, ranks, nodes = check_traces(out / "chakra")
    print(f"  validate: {'ok' if not problems else problems[:3]} ({ranks} ranks, {nodes} nodes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input", type=int, default=128)
    parser.add_argument("--output", type=int, default=8)
    parser.add_argument("--only", choices=sorted(LAYOUTS))
    parser.add_argument("--syntorch", help="the syntorch checkout to run (default: the one imported here)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for label, layout in LAYOUTS.items():
            if args.only in (None, label):
                run(label, *layout, args, Path(tmp))


if __name__ == "__main__":
    main()
