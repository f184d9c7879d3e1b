"""`syntorch train gpt2|bert --data squad.json --nproc 2 [--enable-tracing ...]`: DDP pretraining on SQuAD,
optionally captured with the profiler and converted to Chakra traces (see syntorch/train, syntorch/capture).
A rank that fails, dies or stops responding ends the run with one line naming it (cli.main, exit code 2)."""


def add_parser(subparsers) -> None:
    from syntorch.train.options import add_arguments

    p = subparsers.add_parser("train", help="DDP pretraining of GPT-2/BERT on SQuAD, with Chakra capture")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from syntorch.train.loop import launch
    from syntorch.train.options import options_from_args

    launch(*options_from_args(args))
    return 0
