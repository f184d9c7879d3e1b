"""`syntorch train gpt2|bert --data squad.json --nproc 2 [--tp 2 --pp 2 --zero 1 ...] [--enable-tracing ...]`:
pretraining on SQuAD on a parallel plan (plain DP by default), optionally captured with the profiler and converted to Chakra traces (see syntorch/train, syntorch/capture).
A rank that fails, dies or stops responding ends the run with one line naming it (cli.main, exit code 2)."""


def add_parser(subparsers) -> None:
    from syntorch.train.arguments import add_arguments

    p = subparsers.add_parser("train", help="pretraining of GPT-2/BERT on SQuAD on a parallel plan, with Chakra capture")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from syntorch.train.loop import launch
    from syntorch.train.arguments import options_from_args

    launch(*options_from_args(args))
    return 0
