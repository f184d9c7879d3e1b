"""Identical decode steps drawn once (folds.fold_repeated_steps, the images): which steps fold, their
titles, and that the totals still count every step."""
import re
import xml.etree.ElementTree as ET

import networkx as nx
import pytest
import torch

from conftest import tiny_config
from syntorch.export.image import _label, draw, fold
from syntorch.export.comm_report import tracing_table
from syntorch.generate import Sampling, generate
from syntorch.parallel.mesh import Mesh
from syntorch.trace.comm_view import CommReport
from syntorch.trace.generation import trace_pp_stage, trace_tp_rank
from syntorch.trace.folds import fold_repeated_layers, fold_repeated_steps, grown_entries

PROMPT, NEW_TOKENS, LAYERS = 4, 20, 2  # prefill, then decode[0] .. decode[18]


@pytest.fixture(scope="module")
def generation():
    """Rank 0 of a tiny GPT-2 generating 20 tokens under TP 2 on meta."""
    config = tiny_config("gpt2", n_layer=LAYERS)
    return trace_tp_rank(config, torch.zeros(1, PROMPT, dtype=torch.long), NEW_TOKENS, tp=2, rank=0)[0]


def steps_of(graph):
    folded, repeats = fold_repeated_layers(graph)
    return fold_repeated_steps(folded, repeats)


def phases(graph) -> list[str]:
    return list(dict.fromkeys(d["phase"] for _, d in graph.work()))


def svg_text(path) -> str:
    return " ".join(t.text or "" for t in ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}text"))


def test_grown_entries_allow_one_more_per_step_only():
    assert grown_entries([[1, 4, 5, 16], [2, 3]], [[1, 4, 8, 16], [2, 3]], 3) == [(0, 2)]
    assert grown_entries([[1, 4, 5, 16]], [[1, 4, 7, 16]], 3) is None  # grew by 2 in 3 steps
    assert grown_entries([[1, 4, 5, 16]], [[1, 4, 5]], 1) is None
    assert grown_entries([[1, 4]], [[1, 4], [2]], 1) is None


def test_nineteen_decode_steps_fold_into_one_and_prefill_stays(generation):
    folded, runs = steps_of(generation)
    assert phases(generation) == ["prefill", *(f"decode[{i}]" for i in range(NEW_TOKENS - 1))]
    assert phases(folded) == ["prefill", "decode[0]"]
    (run,) = runs.values()
    assert run.phases == [f"decode[{i}]" for i in range(19)]
    assert run.kv == (PROMPT + 1, PROMPT + 19)  # decode[0] attends to the prompt and its own token
    assert run.title == "decode[0–18] × 19, KV length 5–23"
    assert nx.is_directed_acyclic_graph(folded) and nx.is_weakly_connected(folded)


def test_a_step_that_differs_is_kept_on_its_own(generation):
    graph = generation.copy()
    # decode[5]: an op that reads no growing tensor costs one FLOP more; decode[12]: an attention output
    # grows by 2 instead of 1 (not the KV length)
    addmm = next(n for n, d in graph.ops() if d["phase"] == "decode[5]" and d["name"].startswith("aten.addmm"))
    graph.nodes[addmm]["flops"] += 1
    sdpa = next(n for n, d in graph.ops() if d["phase"] == "decode[12]" and "scaled_dot" in d["name"])
    key = next(t for t in graph.predecessors(sdpa) if graph.nodes[t]["shape"][2] == PROMPT + 13)
    graph.nodes[key]["shape"] = [*graph.nodes[key]["shape"][:2], PROMPT + 14, graph.nodes[key]["shape"][3]]
    folded, runs = steps_of(graph)
    assert [run.label for run in runs.values()] == ["decode[0–4] × 5", "decode[6–11] × 6", "decode[13–18] × 6"]
    assert phases(folded) == ["prefill", "decode[0]", "decode[5]", "decode[6]", "decode[12]", "decode[13]"]


@pytest.mark.parametrize("comm", [False, True])
def test_one_column_for_the_decode_steps_and_totals_of_every_step(generation, tmp_path, comm):
    view = draw(generation, tmp_path / "g.svg", comm=comm)
    assert phases(view) == ["prefill", "decode[0]"]
    text = svg_text(tmp_path / "g.svg")
    assert "decode[0–18] × 19, KV length 5–23" in text and "decode[1]" not in text
    # every forward: the embedding's all-reduce, two per layer, the LM head's all-gather (Megatron TP)
    collectives = NEW_TOKENS * (1 + 2 * LAYERS + 1)
    assert sum(1 for _ in generation.collectives()) == collectives
    drawn = sum(1 for _ in view.collectives())
    assert drawn == 2 * (1 + 2 + 1)  # prefill and one decode step, one layer each
    total = re.search(r"(\d+) collectives, ([\d.]+) (\w?)FLOP in all", text)
    assert int(total[1]) == collectives
    scale = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9}[total[3]]
    assert float(total[2]) * scale == pytest.approx(generation.total_flops(), rel=5e-3)
    assert view.total_flops() < generation.total_flops() / 5  # what is drawn is not the total


def test_one_decode_step_has_nothing_to_fold():
    one_step = trace_tp_rank(tiny_config("gpt2", n_layer=LAYERS), torch.zeros(1, PROMPT, dtype=torch.long), 2,
                             tp=2, rank=0)[0]
    folded, _, runs = fold(one_step)
    assert runs == {} and phases(folded) == ["prefill", "decode[0]"]


def test_growing_tensors_are_labelled_with_their_first_and_last_shapes(generation):
    folded, _ = steps_of(generation)
    (sdpa, *_) = [n for n, d in folded.ops() if d["phase"] == "decode[0]" and "scaled_dot" in d["name"]]
    inputs = [folded.nodes[t] for t in folded.predecessors(sdpa)]
    assert sorted(d["shape"][2] for d in inputs) == [1, PROMPT + 1, PROMPT + 1]  # the query, K and V
    assert sorted(_label(d) for d in inputs) == ["1x2x1x16", "1x2x5–23x16", "1x2x5–23x16"]


@pytest.mark.parametrize("stage", [0, 1])
def test_pipeline_stages_fold_their_steps_and_say_so_in_their_tables(stage):
    """A PP 2 stage: p2p tags count messages on from step to step, and nothing reads the last step's KV
    cache; neither keeps a step apart."""
    prompt = torch.zeros(1, PROMPT, dtype=torch.long, device="meta")
    graph, _ = trace_pp_stage(tiny_config("gpt2", n_layer=4), lambda m, scope, forward: generate(
        m, prompt, NEW_TOKENS, Sampling(temperature=0), phase_scope=scope, forward=forward), Mesh(pp=2), stage)
    folded, runs = steps_of(graph)
    assert phases(folded) == ["prefill", "decode[0]"] and runs["decode[0]"].label == "decode[0–18] × 19"
    report = CommReport(graph)
    assert report.step_runs == {"decode[0]": runs["decode[0]"].phases}
    p2p = "recv" if stage else "send"
    assert f"*{p2p}: {NEW_TOKENS - 1} (" in tracing_table(report, 0, color=False).split("decode[0–18] × 19\n")[1]
