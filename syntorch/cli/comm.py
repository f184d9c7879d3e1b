"""`syntorch comm`: the CommDebugMode report (seed 003) of a saved trace graph, as a table, JSON and HTML."""


def add_parser(sub) -> None:
    p = sub.add_parser("comm", help="collective-debug report (torch's CommDebugMode) of a tensor_trace_graph.json")
    p.add_argument("--input", required=True, help="a tensor_trace_graph.json written by syntorch")
    p.add_argument("--noise_level", default="0", help="0: collective counts per module, 1: + module info, "
                   "collectives and ops on parameters, 2: + all non-trivial ops, 3: everything")
    p.add_argument("--html", help="also write the browser view (one self-contained HTML file) here")
    p.add_argument("--json", help="also write the JSON dump (torch's generate_json_dump fields) here")
    p.add_argument("--log", help="also write the table without colours here")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys

    from syntorch.trace.comm_report import CommReport, check_noise_level
    from syntorch.errors import UserError
    from syntorch.export import comm_report
    from syntorch.export.networkx_json import load

    try:
        noise_level = check_noise_level(int(args.noise_level))
    except ValueError:
        raise UserError(f"noise level must be 0, 1, 2 or 3, got {args.noise_level!r}") from None
    report = CommReport(load(args.input))
    print(comm_report.tracing_table(report, noise_level, color=sys.stdout.isatty()), end="")
    for path, write in ((args.log, comm_report.write_table), (args.json, comm_report.write_json),
                        (args.html, comm_report.write_html)):
        if path:
            write(report, noise_level, path)
            print(f"-> {path}")
    return 0
