"""syntorch validate: a good trace is clean, and breaking it once per ASTRA-sim rule is caught."""
import json
import re

import pytest
from chakra.schema.protobuf import et_def_pb2 as et
from chakra.src.third_party.utils.protolib import encodeMessage
from chakra_graphs import attrs, pp_rank, read_et, tp_rank

from syntorch.cli import main
from syntorch.errors import UserError
from syntorch.chakra.writer import write_chakra
from syntorch.trace.graph import TraceGraph
from syntorch.chakra.rank_templates import RankTemplates
from syntorch.chakra.validator import UNEQUAL_ALL_TO_ALL, validate_traces


def tp_pp_rank(rank: int) -> TraceGraph:
    """Rank of a 4-rank TP2 x PP2 run: TP groups {0,1} and {2,3}, stage 0 sends to stage 1."""
    tp = tp_rank(rank % 2)
    stage = pp_rank(rank // 2)
    g = TraceGraph(model="mix", rank=rank, world_size=4, tp=2, pp=2)
    group = [2 * (rank // 2), 2 * (rank // 2) + 1]
    for source in (tp, stage):
        offset = len(g)
        for n, d in source.nodes(data=True):
            d = dict(d)
            if d["kind"] == "collective":
                d["group"] = group if d["collective"] not in ("send", "recv") else [rank % 2, rank % 2 + 2]
                if d["collective"] == "send":
                    d["src"], d["dst"] = rank, rank + 2
                if d["collective"] == "recv":
                    d["src"], d["dst"] = rank - 2, rank
            g.add_node(n + offset, **d)
        g.add_edges_from((u + offset, v + offset, d) for u, v, d in source.edges(data=True))
    return g


@pytest.fixture
def good(tmp_path):
    out = tmp_path / "chakra"
    write_chakra({r: tp_pp_rank(r) for r in range(4)}, out)
    return out


def rewrite(path, change):
    """Decode a rank with the official reader, let `change(header, nodes)` break it, encode it back."""
    header, nodes = read_et(path)
    header, nodes = change(header, nodes)
    with open(path, "wb") as f:
        if header is not None:
            encodeMessage(f, header)
        for node in nodes:
            encodeMessage(f, node)


def set_attr(node, name, **value):
    kept = [a for a in node.attr if a.name != name]
    del node.attr[:]
    node.attr.extend(kept + ([et.AttributeProto(name=name, **value)] if value else []))


def first(nodes, node_type):
    return next(n for n in nodes if n.type == node_type)


def test_good_trace_is_clean(good, capsys):
    assert json.loads((good / "comm_groups.json").read_text()) == {"10": [0, 1], "11": [0, 2], "12": [1, 3], "13": [2, 3]}
    assert validate_traces(good) == []
    assert validate_traces(good / "mix") == []  # the prefix works too
    _, nodes = read_et(good / "mix.0.et")  # the TP group's collectives in program order; the send on its own
    comms = [n for n in nodes if n.type in (et.COMM_COLL_NODE, et.COMM_SEND_NODE, et.COMM_RECV_NODE)]
    assert [list(n.ctrl_deps) for n in comms] == [[]] + [[a.id] for a in comms[:-2]] + [[]]
    assert comms[-1].type == et.COMM_SEND_NODE and attrs(comms[-1])["pg_name"].string_val == "11"
    assert main(["validate", str(good)]) == 0
    assert capsys.readouterr().out.strip() == "ok: 4 ranks, 32 nodes"  # 6 TP nodes + 2 pipeline nodes per rank


def _dangling(h, nodes):
    nodes[2].data_deps.append(999)
    return h, nodes


def _cycle(h, nodes):
    nodes[0].ctrl_deps.append(nodes[2].id)
    return h, nodes


def _duplicate(h, nodes):
    nodes[3].id = nodes[2].id
    return h, nodes


def _metadata(h, nodes):
    return h, nodes + [et.Node(id=100, name="process_group:init", type=et.METADATA_NODE)]


def _string_comm_type(h, nodes):
    set_attr(first(nodes, et.COMM_COLL_NODE), "comm_type", string_val="ALL_REDUCE")
    return h, nodes


def _no_comm_size(h, nodes):
    set_attr(first(nodes, et.COMM_COLL_NODE), "comm_size")
    return h, nodes


def _unknown_pg(h, nodes):
    set_attr(first(nodes, et.COMM_COLL_NODE), "pg_name", string_val="42")
    return h, nodes


def _not_member(h, nodes):
    set_attr(first(nodes, et.COMM_COLL_NODE), "pg_name", string_val="13")  # group {2, 3}; this is rank 0
    return h, nodes


def _reorder(h, nodes):
    ar, ag = [n for n in nodes if n.type == et.COMM_COLL_NODE][:2]
    for name in ("comm_type", "comm_size"):
        a, b = attrs(ar)[name].int64_val, attrs(ag)[name].int64_val
        set_attr(ar, name, int64_val=b)
        set_attr(ag, name, int64_val=a)
    return h, nodes


def _unmatched_send(h, nodes):
    set_attr(first(nodes, et.COMM_SEND_NODE), "comm_tag", int32_val=8)
    return h, nodes


def _no_header(h, nodes):
    return None, nodes


def _cpu_comm(h, nodes):
    set_attr(first(nodes, et.COMM_COLL_NODE), "is_cpu_op", bool_val=True)
    return h, nodes


def _reduce(h, nodes):
    set_attr(first(nodes, et.COMM_COLL_NODE), "comm_type", int64_val=et.REDUCE)
    return h, nodes


def _foreign_send(h, nodes):
    set_attr(first(nodes, et.COMM_SEND_NODE), "comm_src", int32_val=1)
    return h, nodes


def _int64_peer(h, nodes):
    set_attr(first(nodes, et.COMM_SEND_NODE), "comm_dst", int64_val=2)
    return h, nodes


def _zero_size(h, nodes):
    set_attr(first(nodes, et.COMM_COLL_NODE), "comm_size", int64_val=0)
    return h, nodes


@pytest.mark.parametrize("break_it, expected", [
    (_dangling, "mix.0.et: node 2: data_deps names node 999, which is not in this file"),
    (_cycle, "dependency cycle"),
    (_duplicate, "mix.0.et: node 2: id used by 2 nodes"),
    (_metadata, "mix.0.et: node 100: METADATA_NODE is not allowed"),
    (_string_comm_type, "attribute comm_type is string_val, must be an integer"),
    (_no_comm_size, "COMM_COLL_NODE needs attribute comm_size"),
    (_unknown_pg, "pg_name '42' is not a key of the comm-group JSON"),
    (_not_member, "rank 0 issues a collective of group 13 [2, 3] without being in it"),
    (_reorder, "mix.1.et: node 1: collective #0 of group 10 is ALL_REDUCE of 128 B but rank 0 issues ALL_GATHER of 128 B"),
    (_unmatched_send, "mix.0.et: node 7: send to rank 2 (tag 8, 128 B) has no matching recv on rank 2"),
    (_no_header, "mix.0.et: does not start with a GlobalMetadata message"),
    (_cpu_comm, "communication node with is_cpu_op true"),
    (_reduce, "comm_type REDUCE throws in ASTRA-sim"),
    (_zero_size, "comm_size is 0"),
    (_int64_peer, "mix.0.et: node 7: attribute comm_dst is int64_val, must be an int32_val"),
    (_foreign_send, "mix.0.et: node 7: comm_src is 1 in rank 0's file; drop it or make it 0"),
])
def test_each_broken_rule_is_caught(good, capsys, break_it, expected):
    rewrite(good / "mix.0.et", break_it)
    problems = validate_traces(good)
    assert any(expected in p for p in problems), problems
    assert main(["validate", str(good)]) == 1
    out = capsys.readouterr().out
    assert expected in out and re.search(r"^\d+ problems? in 4 ranks$", out, re.M)


BREAKS = [_dangling, _cycle, _duplicate, _metadata, _string_comm_type, _no_comm_size, _unknown_pg, _not_member,
          _reorder, _unmatched_send, _no_header, _cpu_comm, _reduce, _zero_size, _int64_peer, _foreign_send]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("break_it", BREAKS)
def test_ranks_checked_as_their_template_get_every_verdict_of_a_whole_check(good, monkeypatch, break_it, rank):
    """A rank that is a checked rank's file but for some communication nodes is checked as that template with
    those nodes checked again (rank_templates.py): the problems are those of checking every rank whole, with
    the broken rank the template (rank 0) or one compared with it (1)."""
    rewrite(good / f"mix.{rank}.et", break_it)
    matched = []
    match = RankTemplates.match
    monkeypatch.setattr(RankTemplates, "match", lambda self, *a: matched.append(match(self, *a)) or matched[-1])
    fast = validate_traces(good)
    monkeypatch.setattr(RankTemplates, "match", lambda self, *a: None)  # every rank checked whole
    assert fast == validate_traces(good)
    assert fast or (break_it, rank) == (_foreign_send, 1)  # comm_src 1 is rank 1's own
    assert any(matched)  # rank 1 (TP peer of rank 0) or 3 (of rank 2): the same bytes but for group ids and peers


def test_roofline_needs_ops_and_bytes(good):
    assert validate_traces(good, roofline=True) == []
    rewrite(good / "mix.1.et", lambda h, nodes: (h, [set_attr(nodes[0], "num_ops", int64_val=0) or n for n in nodes]))
    assert validate_traces(good) == []  # replay mode reads duration_micros only
    assert validate_traces(good, roofline=True) == ["mix.1.et: node 0: num_ops is 0; under ASTRA-sim's roofline "
                                                    "its time would be 0/0: write a positive value"]


def test_unmatched_recv_and_missing_rank(good):
    rewrite(good / "mix.3.et", lambda h, nodes: (h, [n for n in nodes if n.type != et.COMM_RECV_NODE]))
    assert any("mix.1.et: node" in p and "no matching recv on rank 3" in p for p in validate_traces(good))
    (good / "mix.3.et").unlink()
    assert "comm_groups.json: group 13 lists rank(s) [3] that have no trace file" in validate_traces(good)
    (good / "mix.1.et").unlink()
    assert any("ranks [0, 2] are not 0..1" in p for p in validate_traces(good))


@pytest.mark.parametrize("content, message", [
    (b"\x05abc", "corrupt .et"),
    (b"\x80", "corrupt .et"),
    (b"", "empty .et"),
])
def test_corrupt_file_is_a_user_error(tmp_path, content, message):
    """(syntorch validate's one line and exit 2 for these: test_bad_inputs.py)"""
    (tmp_path / "bad.0.et").write_bytes(content)
    with pytest.raises(UserError, match=message):
        validate_traces(tmp_path)


def test_nothing_to_validate(tmp_path):
    with pytest.raises(UserError, match="no <prefix>.<rank>.et files"):
        validate_traces(tmp_path)
    (tmp_path / "comm_groups.json").write_text("[1, 2]")
    (tmp_path / "a.0.et").write_bytes(b"")
    with pytest.raises(UserError, match="integer-string keys"):
        validate_traces(tmp_path / "a")


def test_a_broken_node_shared_by_ranks_is_reported_in_each(good):
    """Nodes checked once per distinct bytes are still reported once per file that holds them."""
    def metadata_node(h, nodes):
        nodes[0].type = et.METADATA_NODE  # a compute node every rank of the stage has byte for byte
        return h, nodes
    for rank in (0, 1):
        rewrite(good / f"mix.{rank}.et", metadata_node)
    assert read_et(good / "mix.0.et")[1][0] == read_et(good / "mix.1.et")[1][0]  # the same node in both files
    problems = [p for p in validate_traces(good) if "METADATA_NODE" in p]
    assert [p.split(":")[0] for p in problems] == ["mix.0.et", "mix.1.et"]


@pytest.mark.parametrize("comm_type", [et.ALL_REDUCE, et.ALL_GATHER, et.REDUCE_SCATTER, et.BROADCAST, et.ALL_TO_ALL])
def test_members_of_unequal_sizes_are_caught_an_all_to_all_with_why(good, comm_type):
    """Rank 1 issues group 10's first collective with twice rank 0's comm_size. An all-to-all's members would
    move what each routes (a skewed MoE load), but ASTRA-sim matches its messages by size and hangs."""
    def sized(size):
        def change(h, nodes):
            node = first(nodes, et.COMM_COLL_NODE)
            set_attr(node, "comm_type", int64_val=comm_type)
            set_attr(node, "comm_size", int64_val=size)
            return h, nodes
        return change
    rewrite(good / "mix.0.et", sized(128))
    rewrite(good / "mix.1.et", sized(256))
    name = et.CollectiveCommType.Name(comm_type)
    why = UNEQUAL_ALL_TO_ALL if comm_type == et.ALL_TO_ALL else "every member must issue the group's collectives in the same order"
    assert validate_traces(good) == [f"mix.1.et: node 1: collective #0 of group 10 is {name} of 256 B but rank 0 "
                                     f"issues {name} of 128 B; {why}"]
