"""`syntorch compare REAL_DIR SYMBOLIC_DIR`: does a captured run communicate as its symbolic trace says?
One line per difference (exit 1), or one line saying they are equal (exit 0)."""

DESCRIPTION = """\
Lines up the Chakra traces of a captured run (syntorch train --enable-tracing) and of the symbolic trace of
the same plan (syntorch trace), rank by rank: the same collectives in the same order with the same bytes and
groups (sets of global ranks, from each folder's comm_groups.json), and the same sends and recvs (peer,
bytes). Each difference is one line: rank, position in the rank's communication, what differs.

Compared per group instead of per rank: an all-to-all's bytes (MoE dispatch and combine follow the real
router; the symbolic trace routes evenly), whose total over the group's members must match.
Not filtered: nothing. The capture records the profiled optimizer step only, so set-up (init broadcasts,
barriers), loss logging and evaluation collectives are outside both traces.

Exit status: 0 equal, 1 different, 2 bad input."""


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser("compare", help="compare a captured run's communication with its symbolic trace, rank by rank",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("real", metavar="REAL_DIR", help="folder (or prefix) of the captured run's <prefix>.<rank>.et")
    p.add_argument("symbolic", metavar="SYMBOLIC_DIR", help="folder (or prefix) of syntorch trace's <prefix>.<rank>.et")
    p.set_defaults(func=run)


def run(args) -> int:
    from syntorch.chakra.comm_diff import compare
    from syntorch.cli.validate import plural

    lines, counts = compare(args.real, args.symbolic)
    for line in lines:
        print(line)
    if lines:
        print(f"{plural(len(lines), 'difference')}")
        return 1
    print(f"equal: {plural(counts['ranks'], 'rank')}, {plural(counts['collectives'], 'collective')}, "
          f"{plural(counts['p2p'], 'send/recv')}")
    return 0
