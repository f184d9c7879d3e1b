"""`torchrun --nproc_per_node=N -m syntorch.train gpt2|bert ...` (or plain `python -m syntorch.train`): the same
options, checks and error reporting as `syntorch train`."""
import sys

from syntorch.errors import run_command
from syntorch.train.loop import launch
from syntorch.train.options import add_arguments, options_from_args


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m syntorch.train", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_command("python -m syntorch.train", lambda: launch(*options_from_args(args)))


if __name__ == "__main__":
    sys.exit(main())
