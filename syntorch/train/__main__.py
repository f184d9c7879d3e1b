"""`torchrun --nproc_per_node=N -m syntorch.train gpt2|bert ...` (or plain `python -m syntorch.train`): the same
options, checks and error reporting as `syntorch train`."""
import sys

from syntorch.errors import run_command
from syntorch.options import Parser
from syntorch.train.loop import launch
from syntorch.train.arguments import add_arguments, options_from_args


def main(argv=None) -> int:
    parser = Parser(prog="python -m syntorch.train", description=__doc__)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0), or a mistake in the options (2), already printed as one line
        return e.code
    return run_command(parser.prog, lambda: launch(*options_from_args(args)))


if __name__ == "__main__":
    sys.exit(main())
