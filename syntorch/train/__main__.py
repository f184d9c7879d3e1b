"""`torchrun --nproc_per_node=N -m syntorch.train gpt2|bert ...` (or plain `python -m syntorch.train`)."""
import sys

from syntorch.errors import RankFailed, UserError
from syntorch.train.loop import launch
from syntorch.train.options import add_arguments, options_from_args


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m syntorch.train", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        launch(*options_from_args(args))
    except (UserError, RankFailed) as e:
        print(f"syntorch.train: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
