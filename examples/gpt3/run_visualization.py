"""Seed 000's command, verbatim: python run_visualization.py --input tensor_trace_graph.json --output graph.svg --format svg

A thin wrapper of `syntorch export` (formats: svg, png, graphml, perfetto, chakra, json).
"""
import sys

from syntorch.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))
