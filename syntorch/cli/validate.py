"""`syntorch validate DIR|PREFIX`: will ASTRA-sim run these Chakra traces? One line per problem."""


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help="check Chakra .et traces against ASTRA-sim's rules (exit 1 on problems)")
    p.add_argument("path", help="folder of <prefix>.<rank>.et files, or the prefix itself (e.g. runs/g175/chakra/gpt3-175b)")
    p.add_argument("--comm_groups", help="comm-group JSON given to ASTRA-sim (default: comm_groups.json beside the traces)")
    p.add_argument("--roofline", action="store_true", help="also require num_ops and tensor_size on compute nodes")
    p.set_defaults(func=run)


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def run(args) -> int:
    from syntorch.chakra.validator import check_traces

    problems, ranks, nodes = check_traces(args.path, args.comm_groups, args.roofline)
    for line in problems:
        print(line)
    if problems:
        print(f"{plural(len(problems), 'problem')} in {plural(ranks, 'rank')}")
        return 1
    print(f"ok: {plural(ranks, 'rank')}, {plural(nodes, 'node')}")
    return 0
