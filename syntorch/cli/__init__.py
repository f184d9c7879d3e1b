"""`syntorch <command>`: one module per command in this package, each with add_parser(subparsers).

A command module parses and validates, then calls library functions; it holds no logic of its own.
"""
import argparse
import gc
import importlib
import pkgutil
import sys

from syntorch.errors import run_command
from syntorch.options import Parser


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
    return run_command(f"syntorch {args.command}", lambda: args.func(args))


# A command builds large structures that live to its end and hold few cycles (torch's modules, the traced
# graphs: 10^5-10^6 small dicts); each full pass of the cyclic collector rescans all of them, ~0.8 of the
# 5 CPU seconds of a symbolic 175B run with images and Chakra. Young collections still run as usual (they
# reclaim what a command drops, matplotlib figures, exceptions); a full pass waits 1000 of them (default 10).
COLLECTOR_THRESHOLDS = (700, 10, 1000)


def run_main():
    gc.set_threshold(*COLLECTOR_THRESHOLDS)
    code = main()
    # the process ends: the interpreter's own full passes at exit would scan every object torch made for
    # nothing (~0.5 s); what it frees by reference counting (closing files, ...) it still frees
    gc.freeze()
    sys.exit(code)
