"""`torchrun --nproc_per_node=N -m syntorch.train gpt2|bert ...` (or plain `python -m syntorch.train`): the
options, checks and one-line errors of `syntorch train`."""
import sys

from syntorch.errors import RankFailed, UserError
from syntorch.options import Parser
from syntorch.train.loop import launch
from syntorch.train.options import add_arguments, options_from_args


def main(argv=None) -> int:
    parser = Parser(prog="python -m syntorch.train", description=__doc__)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0), or a mistake in the options (2), already printed as one line
        return e.code
    try:
        launch(*options_from_args(args))
    except (UserError, RankFailed) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
