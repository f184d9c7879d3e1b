"""Per-rank Chakra files of symbolic pipeline inference written from each stage's representative
(chakra/stage_files.py) equal those written rank by rank from every rank's translated graph (write_chakra),
byte for byte, with the same summary; also where a rank's peers need a longer varint than its
representative's (ranks past 127), at the module level and with durations; a rank whose collectives took
other durations is noticed."""
import filecmp

import pytest
import torch

from conftest import tiny_config
from syntorch.chakra.stage_files import same_durations, write_stage_chakra
from syntorch.chakra.writer import write_chakra
from syntorch.generate import Sampling, generate
from syntorch.hardware import load_hw_config
from syntorch.parallel.assemble import RankPlan
from syntorch.parallel.mesh import Mesh
from syntorch.trace.cost import fill_rank_durations
from syntorch.trace.generation import trace_pp_symbolic

CASES = {
    "tp2 pp2 beam": (tiny_config("gpt2", n_layer=4), Mesh(pp=2, tp=2), 2, "op", None),
    "tp2 pp2 module": (tiny_config("gpt2", n_layer=4), Mesh(pp=2, tp=2), 1, "module", None),
    "tp2 pp2 durations": (tiny_config("gpt2", n_layer=4), Mesh(pp=2, tp=2), 1, "op", "h100-sxm"),
    # stage 1 is ranks 48..95: rank 48 sends to 96 (a 1-byte varint), rank 80 to 128 (2 bytes)
    "144 ranks": (tiny_config("gpt2", n_layer=3, d_model=96, n_head=48, d_head=2, d_ff=192), Mesh(pp=3, tp=48), 1,
                  "op", None),
}


def traced(config, mesh, beam_width=1):
    def run(m, scope, forward):
        return generate(m, torch.zeros(2, 4, dtype=torch.long, device="meta"), 3, Sampling(temperature=0),
                        beam_width=beam_width, phase_scope=scope, forward=forward)
    return trace_pp_symbolic(config, run, RankPlan(tp=mesh.tp, pp=mesh.pp, mode="infer"), beam_width)[0]


@pytest.mark.parametrize("case", CASES)
def test_stage_encodings_equal_rank_by_rank_files(tmp_path, case):
    config, mesh, beam_width, level, hw = CASES[case]
    traces = traced(config, mesh, beam_width)
    if hw:  # as `infer --hw_config` costs them: each rank's graph on its own
        fill_rank_durations(traces, load_hw_config(hw))
        assert same_durations(traces)
    fast = write_stage_chakra(traces, tmp_path / "stages", level)
    slow = write_chakra(traces, tmp_path / "ranks", level=level)  # reads every rank's translated graph
    names = sorted(p.name for p in (tmp_path / "ranks").iterdir())
    assert len(names) == mesh.world_size + 3  # .et per rank, comm_groups.json, the JSON form, the folder mark
    assert sorted(p.name for p in (tmp_path / "stages").iterdir()) == names
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "stages", tmp_path / "ranks", names, shallow=False)
    assert not mismatch and not errors and len(match) == len(names)
    for summary in (fast, slow):
        del summary["dir"], summary["prefix"]
    assert fast == slow


def test_a_rank_whose_collectives_took_other_durations_is_noticed():
    traces = traced(tiny_config("gpt2", n_layer=4), Mesh(pp=2, tp=2))
    fill_rank_durations(traces, load_hw_config("h100-sxm"))
    rank3 = traces[3]
    first = next(n for n, _ in rank3.collectives())
    rank3.node_attrs[first]["duration_us"] *= 2  # its own dict: a translated graph copies its collectives
    assert not same_durations(traces)
