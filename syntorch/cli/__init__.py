"""`syntorch <command>`: one module per command in this package, each with add_parser(subparsers).

A command module parses and validates, then calls library functions; it holds no logic of its own.
"""
import argparse
import importlib
import os
import pkgutil
import signal
import sys

from syntorch.errors import RankFailed, UserError
from syntorch.options import Parser


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so every `finally` runs: spawned
    ranks are stopped (parallel.launch.spawn) and temporary output folders removed (outdir)."""


def _terminate(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a repeated SIGTERM must not cut short the cleanup it asks for
    raise Terminated


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="syntorch", description="Run, parallelize and trace LLM workloads.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}").add_parser(sub)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0), or a mistake in the options (2), already printed as one line
        return e.code
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.func(args) or 0
    except (UserError, RankFailed) as e:  # a rank that raised, died or stopped reads like a user's error
        print(f"syntorch {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"syntorch {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"syntorch {args.command}: terminated", file=sys.stderr)
        return 143  # 128 + SIGTERM, as a shell reports a process SIGTERM ended
    except BrokenPipeError:  # stdout piped into a reader that stopped (`| head`): not an error worth a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush does not fail again
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_main():
    sys.exit(main())
