"""`syntorch convert --host H --device D --rank R --output X.et`: one rank's profiler traces captured
elsewhere -> an ASTRA-sim-ready Chakra trace (linked and converted with mlc-chakra, then repaired)."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("convert", help="host + device profiler traces of one rank -> Chakra .et")
    p.add_argument("--host", required=True, help="host execution trace (ExecutionTraceObserver JSON)")
    p.add_argument("--device", required=True, help="device trace (Kineto JSON) of the same rank and steps")
    p.add_argument("--rank", type=int, required=True, at_least=0, help="the rank the traces are of")
    p.add_argument("--output", required=True, help="the .et to write, named <prefix>.<rank>.et (e.g. out/gpt2.0.et)")
    p.add_argument("--merged", help="also keep the linked host + device JSON here")
    p.add_argument("--comm_groups", "--comm-groups", dest="comm_groups",
                   help="write the comm-group JSON here (default: comm_groups.json beside --output)")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from syntorch.capture.to_chakra import convert_rank

    comm_groups = args.comm_groups or Path(args.output).parent / "comm_groups.json"
    result = convert_rank(args.host, args.device, args.rank, args.output, args.merged, comm_groups)
    print(f"{args.output}: {result['nodes']} nodes, {result['collectives']} collectives of {result['comm_bytes']} B")
    for note in result["repairs"] + result["notes"]:
        print(f"  note: {note}")
    return 0
