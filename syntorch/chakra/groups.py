"""Comm-group ids: what a communication node's `pg_name` names and `comm_groups.json` lists.

One scheme for every writer: the groups in a fixed order get ids first, first + 1, ... where first is the
smallest power of ten with as many digits as the last id (10, 11, ... for up to 90 groups; 1000, 1001, ...
for up to 9000), so every id has the same number of digits and a rank's file can be another rank's with
equal-length strings swapped (writer.StageTemplate). "0" would mean all ranks to ASTRA-sim: never used.
"""
import json
from collections.abc import Iterable


def group_ids(groups: Iterable) -> dict[tuple[int, ...], int]:
    """Each distinct group (its ranks, in any order) -> its id, in order of first appearance."""
    distinct = list(dict.fromkeys(tuple(sorted(g)) for g in groups))
    first = 10 ** len(str(len(distinct)))
    return {g: first + i for i, g in enumerate(distinct)}


def graph_group_ids(graphs) -> dict[tuple[int, ...], int]:
    """The ids of every group the graphs' collectives use (a saved graph carries no mesh)."""
    return group_ids(d["group"] for g in graphs for _, d in g.collectives())


def comm_groups_json(ids: dict[tuple[int, ...], int]) -> str:
    """ASTRA-sim's --comm-group-configuration: {"10": [0, 1], ...}."""
    return json.dumps({str(i): list(g) for g, i in ids.items()})
