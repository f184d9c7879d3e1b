"""The command line every syntorch parser shares (`syntorch <command>` and `python -m syntorch.train`): a
mistake in an option is one line, naming the option as the user typed it.

`Parser` is argparse with:
- one-line errors: `syntorch trace: error: argument --seq: invalid int value: 'x'`, without the usage block
  argparse prints first (exit code 2, as argparse's);
- every `type=float` option refusing NaN and infinity: NaN compares false with every bound, so
  `--top_p nan` or `calibrate --seconds nan` (which never ended) slipped past the range checks;
- every `type=int` option refusing what 64 bits do not hold (torch's integers: `--batch_size 10**21` was an
  OverflowError);
- `at_least=`, `above=` and `at_most=` on add_argument: a bound checked as the option is parsed, so the message names
  the spelling typed (`--num-gpus 0`, not its other spelling `--nproc`).
The checks hold for the parser's argument groups and subcommands too. Ranges that a library object checks
itself (InferenceSpec, TrainPlan, Sampling, for Python callers as well) are left to it.
"""
import argparse
import math


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the default action of add_argument (groups share the registry; subcommands are made of this class)
        self.register("action", None, _Store)
        self.register("action", "store", _Store)

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an unknown option is reported by the subcommand it was given to
        (`syntorch infer: error: unrecognized arguments: --x`, where argparse names `syntorch`)."""
        namespace, extra = self.parse_known_args(args, namespace)
        if extra:
            self._subcommand(namespace).error(f"unrecognized arguments: {' '.join(extra)}")
        return namespace

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def _subcommand(self, namespace) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(namespace, action.dest, None))
                return chosen._subcommand(namespace) if isinstance(chosen, Parser) else chosen or self
        return self


class _Store(argparse.Action):
    """argparse's "store", checking the value first (see the module docstring)."""

    def __init__(self, *args, at_least=None, above=None, at_most=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.at_least, self.above, self.at_most = at_least, above, at_most

    def __call__(self, parser, namespace, values, option_string=None):
        for value in values if isinstance(values, list) else [values]:
            problem = self.problem(value)
            if problem:
                raise argparse.ArgumentError(None, f"{option_string or self.metavar or self.dest} {problem}")
        setattr(namespace, self.dest, values)

    def problem(self, value) -> str | None:
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        if isinstance(value, int) and not -2**63 <= value < 2**63:
            return f"must fit in 64 bits (below 2**63), got {value}"
        if self.at_least is not None and value < self.at_least:
            return f"must be {'0 or more' if self.at_least == 0 else f'at least {self.at_least}'}, got {value}"
        if self.above is not None and value <= self.above:
            return f"must be {'positive' if self.above == 0 else f'more than {self.above}'}, got {value}"
        if self.at_most is not None and value > self.at_most:
            return f"must be at most {self.at_most}, got {value}"
        return None


def named(text: str) -> str:
    """An option that names something (a preset, a file): an empty string names nothing."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name something, got an empty string")
    return text
