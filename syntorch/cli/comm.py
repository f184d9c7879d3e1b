"""`syntorch comm`: the CommDebugMode report (seed 003) of a saved trace graph, as a table, JSON and HTML."""


def add_parser(sub) -> None:
    p = sub.add_parser("comm", help="collective-debug report (torch's CommDebugMode) of a tensor_trace_graph.json")
    p.add_argument("--input", required=True, help="a tensor_trace_graph.json written by syntorch")
    p.add_argument("--noise_level", type=int, default=0, help="0: collective counts per module, 1: + module info, "
                   "collectives and ops on parameters, 2: + all non-trivial ops, 3: everything")
    p.add_argument("--html", help="also write the browser view (one self-contained HTML file) here")
    p.add_argument("--json", help="also write the JSON dump (torch's generate_json_dump fields) here")
    p.add_argument("--log", help="also write the table without colours here")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys

    from syntorch.trace.comm_view import CommReport, check_noise_level
    from syntorch.export import comm_report
    from syntorch.export.networkx_json import load

    noise_level = check_noise_level(args.noise_level, "--noise_level")
    report = CommReport(load(args.input))
    files = {f"--{kind}": (kind, path) for kind, path in (("log", args.log), ("json", args.json), ("html", args.html))
             if path}
    comm_report.write_reports(report, noise_level, files)  # all or none, before anything is printed
    print(comm_report.tracing_table(report, noise_level, color=sys.stdout.isatty()), end="")
    for _, path in files.values():
        print(f"-> {path}")
    return 0
