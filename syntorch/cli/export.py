"""`syntorch export`: a saved trace graph (tensor_trace_graph.json) to another format, as seed 000's
run_visualization.py does."""
from syntorch.export import EXPORTERS, NAMED_BY_SUFFIX


def add_parser(sub) -> None:
    from syntorch.cli.predict import add_attention

    p = sub.add_parser("export", help="convert a tensor_trace_graph.json to svg, png, graphml, perfetto, chakra, json")
    p.add_argument("--input", required=True, help="a tensor_trace_graph.json written by syntorch")
    p.add_argument("--output", required=True, help="output file (a folder for chakra)")
    p.add_argument("--format", help=f"one of {', '.join(EXPORTERS)} (default: the one --output's suffix names: "
                                    f"{', '.join(NAMED_BY_SUFFIX)})")
    p.add_argument("--force", action="store_true",
                   help="chakra: replace an earlier syntorch run's traces in --output (a file --output is always replaced)")
    p.add_argument("--trace_level", choices=["op", "module", "layer"], default=None,
                   help="collapse to one node per op, module or layer (images default to the finest readable)")
    p.add_argument("--hw_config", help="perfetto: durations from this hardware preset or JSON file's performance "
                                       "model (default: the graph's own, traced with --hw_config)")
    p.add_argument("--profile", default="eager", choices=["eager", "fused"], help="perfetto: with --hw_config, "
                   "how ops group into kernels")
    add_attention(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from syntorch.export import exporter, output_format
    from syntorch.export.networkx_json import load

    fmt = output_format(args.output, args.format)  # before the input is read
    graph = load(args.input)
    options = {"level": args.trace_level} if args.trace_level else {}
    if fmt == "chakra":  # the one format written as a folder (syntorch.outdir)
        options["force"] = args.force
    if fmt == "perfetto" and args.hw_config:
        options.update(hw_config=args.hw_config, profile=args.profile, attention=args.attention)
    exporter(fmt)(graph, args.output, **options)
    print(f"{args.input} -> {args.output} ({fmt})")
    return 0
