"""The collective report lists identical decode steps once (CommReport.step_runs): the table, the browser
view's tables; counts and bytes still count every step, and the JSON keeps every collective."""
import json
import re

import pytest
import torch

from conftest import tiny_config
from syntorch.export.comm_report import json_tree, render_html, tracing_table
from syntorch.trace.comm_view import CommReport
from syntorch.trace.generation import trace_tp_rank

PROMPT, NEW_TOKENS, LAYERS = 4, 20, 2
STEPS = [f"decode[{i}]" for i in range(NEW_TOKENS - 1)]
PER_FORWARD = 1 + 2 * LAYERS + 1  # Megatron TP: the embedding's all-reduce, two per layer, the head's all-gather


@pytest.fixture(scope="module")
def generation():
    config = tiny_config("gpt2", n_layer=LAYERS)
    return trace_tp_rank(config, torch.zeros(1, PROMPT, dtype=torch.long), NEW_TOKENS, tp=2, rank=0)[0]


def rows(page: str, table: int) -> list[list[str]]:
    """The cells of the page's `table`-th table after the module tree (0: per phase totals, last: collectives)."""
    tables = re.findall(r"<table>(.*?)</table>", page)
    return [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", tables[table])[1:]]


def test_steps_fold_in_the_table_and_totals_count_every_step(generation):
    report = CommReport(generation)
    assert report.step_runs == {"decode[0]": STEPS}
    table = tracing_table(report, 2, color=False)
    collective_lines = re.findall(r"\*\*c10d\.\w+( \(.*\))?$", table, re.MULTILINE)
    assert len(collective_lines) == 2 * PER_FORWARD  # prefill's, and one decode step's standing for 19
    assert collective_lines.count(" (decode[0–18] × 19)") == PER_FORWARD
    assert "decode[1]" not in table
    assert f"*all_reduce: {NEW_TOKENS * (PER_FORWARD - 1)} " in table.split("\n", 3)[2]  # Global: every step
    decode_rows = table.split("decode[0–18] × 19\n")[-1]
    assert decode_rows.startswith(f"    *all_reduce: {19 * (PER_FORWARD - 1)} (") and \
        f", {PER_FORWARD - 1} (" in decode_rows.splitlines()[0]
    assert f"all phases: {NEW_TOKENS * PER_FORWARD} collectives" in table
    # the attention reads a KV cache one longer each step: 5 (4 prompt tokens and one new) to 23
    assert "shape: [[1, 2, 1, 16], [1, 2, 5–23, 16], [1, 2, 5–23, 16]]" in table


def test_the_html_has_one_row_per_folded_run_and_the_json_every_collective(generation):
    tree = json_tree(CommReport(generation), 1)
    assert len(tree["collectives"]) == NEW_TOKENS * PER_FORWARD
    assert json.loads(json.dumps(tree))["step_runs"] == {"decode[0]": STEPS}
    page = render_html(tree)
    collectives = rows(page, -1)
    assert len(collectives) == 2 * PER_FORWARD
    assert sum(int(r[3]) for r in collectives) == NEW_TOKENS * PER_FORWARD  # the steps column
    assert {r[2] for r in collectives} == {"prefill", "decode[0–18] × 19"}
    first, last = (c["order"] for c in tree["collectives"] if c["module"] == "tok_emb" and c["phase"] in
                   ("decode[0]", "decode[18]"))
    (tok_emb,) = [r for r in collectives if r[1] == "tok_emb" and r[3] == "19"]
    assert tok_emb[8] == f"{first}…{last}" and last == first + 18 * PER_FORWARD  # its order in the first and last
    totals = rows(page, 0)
    assert totals[2:] == [["decode[0–18] × 19", "all_reduce", f"{19 * 5} (5 a step)", totals[2][3]],
                          ["decode[0–18] × 19", "all_gather", "19 (1 a step)", totals[3][3]]]


def test_a_step_that_differs_is_listed_on_its_own(generation):
    graph = generation.copy()
    changed = next(n for n, d in graph.collectives() if d["phase"] == "decode[7]")
    graph.nodes[changed]["bytes"] += 4
    report = CommReport(graph)
    assert list(report.step_runs.values()) == [STEPS[:7], STEPS[8:]]
    table = tracing_table(report, 0, color=False)
    assert "decode[0–6] × 7" in table and "\n  decode[7]\n" in table and "decode[8–18] × 11" in table
    assert f"all phases: {NEW_TOKENS * PER_FORWARD} collectives" in table
