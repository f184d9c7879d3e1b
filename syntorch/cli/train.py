"""`syntorch train gpt2|bert --data squad.json --nproc 2 [--enable-tracing ...]`: DDP pretraining on SQuAD,
optionally captured with the profiler and converted to Chakra traces (see syntorch/train, syntorch/capture)."""
import sys


def add_parser(subparsers) -> None:
    from syntorch.train.options import add_arguments

    p = subparsers.add_parser("train", help="DDP pretraining of GPT-2/BERT on SQuAD, with Chakra capture")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from syntorch.parallel.launch import RankFailed
    from syntorch.train.loop import launch
    from syntorch.train.options import options_from_args

    try:
        launch(*options_from_args(args))
    except RankFailed as e:  # a crash, not a user's mistake: the cause, and exit 1 (the others were stopped)
        print(f"syntorch train: {e}", file=sys.stderr)
        return 1
    return 0
