"""Seed 000's command, verbatim: python inference.py --num_input_tokens 10 --num_output_tokens 20 --tp 1 --device cpu

A thin wrapper of `syntorch infer --model gpt3-125m`. As the seed's script did, it writes its files into the
current folder (beside your own, which it never touches) and replaces the ones an earlier run of it wrote,
unless --out is given.
"""
import sys

from syntorch.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(a == "--out" or a.startswith("--out=") for a in args):
        args += ["--out", ".", "--force"]
    sys.exit(main(["infer", *args]))
