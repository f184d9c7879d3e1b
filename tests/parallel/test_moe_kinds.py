"""Rank kinds under a skewed routing load (parallel/moe_load.py's RankKinds): each stage's kinds traced once
and translated to their ranks, against tracing every rank on its own -- the graphs, the Chakra files and the
node-level simulation -- and the step-level prediction, which a skew makes differ from a uniform load."""
import copy

import pytest
import torch
from conftest import tiny_config
from test_pipeline import _nodes_by_members

from syntorch.chakra.validator import check_traces
from syntorch.chakra.writer import write_chakra
from syntorch.hardware import load_hw_config
from syntorch.parallel.moe_load import parse_load, rank_kinds
from syntorch.parallel.plans import TrainPlan
from syntorch.simulate.chakra_files import predict_traces
from syntorch.simulate.engine import simulate
from syntorch.simulate.graphs import MeshFrame, RankFrame, kind_programs
from syntorch.simulate.prediction import predict_training
from syntorch.trace.cost import fill_durations
from syntorch.trace.graph import RankTraces
from syntorch.trace.training import trace_stage
from syntorch.workload import trace_workload, write_workload

MOE = tiny_config("gpt2", n_layer=4, vocab_size=200, n_experts=4, moe_top_k=2)
HW = load_hw_config("h100-sxm")


def skewed(**fields) -> TrainPlan:
    return TrainPlan(**fields, microbatches=2, seq=16, moe_load=parse_load("zipf:1.2", MOE))


PLANS = [skewed(dp=4, ep=2, pp=2), skewed(dp=2, tp=2, ep=4, etp=1, pp=2),  # EP from DP; EP over TP and DP
         skewed(dp=2, cp=2, ep=4)]  # EP over CP and DP


@pytest.fixture(scope="module", params=PLANS, ids=["ep2-dp4-pp2", "ep4-tp2-etp1-dp2-pp2", "ep4-cp2-dp2"])
def each_rank(request):
    """The plan and every rank traced on its own."""
    plan = request.param
    traced = RankTraces(plan.mesh.world_size)
    for rank in range(plan.mesh.world_size):
        traced.put(rank, trace_stage(MOE, plan, plan.mesh.coordinate(rank).pp, rank=rank))
    return plan, traced


def test_a_skewed_load_makes_a_kind_per_ep_rank(each_rank):
    plan, _ = each_rank
    kinds = rank_kinds(plan.mesh, plan.moe_load)
    assert kinds.groups == [[e] for e in range(plan.ep)]  # zipf: every EP rank's experts get other shares
    assert sum(kinds.ranks(k) for k in range(kinds.count)) == plan.mesh.world_size // plan.pp


def test_ranks_written_from_their_kinds_equal_tracing_each_rank(each_rank, tmp_path):
    plan, traced = each_rank
    # node for node: every op and collective, a skewed load's all-to-alls as sends and recvs
    write_chakra(traced, tmp_path / "each", MOE.name, level="op", p2p_all_to_all=True)
    workload = trace_workload(MOE, plan, torch.float32)
    summary = write_workload(workload, tmp_path / "kinds", level="op", progress=False)
    each, kinds = _nodes_by_members(tmp_path / "each"), _nodes_by_members(tmp_path / "kinds")
    assert sorted(kinds) == list(range(plan.mesh.world_size))
    for rank in kinds:
        assert kinds[rank] == each[rank], f"rank {rank}"
    # the kinds compute and move different amounts: more than a body per stage, but for groups and peers
    # (EP4's two least loaded kinds round to the same counts of their 16 pairs)
    assert len({repr([(n[:10], dict(n[-1]).get("comm_size")) for n in kinds[r]]) for r in kinds}) > plan.pp
    assert [len(s["rank_kinds"]) for s in summary["stages"]] == [plan.ep] * plan.pp
    # the all-to-alls of unequal sizes, on which ASTRA-sim would hang, are sends and recvs that all meet
    assert check_traces(tmp_path / "kinds")[0] == []
    # predict reads each stage's kinds' representatives, as it reads every rank
    symmetric, every = predict_traces(tmp_path / "kinds", HW), predict_traces(tmp_path / "each", HW)
    assert len(symmetric.run.programs) == plan.pp * plan.ep
    assert symmetric.summary["step_s"] == pytest.approx(every.summary["step_s"], rel=1e-9)


def test_simulating_each_kind_once_equals_simulating_every_rank(each_rank):
    plan, traced = each_rank
    mesh, kinds = plan.mesh, rank_kinds(plan.mesh, plan.moe_load)
    traced = {r: copy.deepcopy(traced[r]) for r in range(mesh.world_size)}
    for graph in traced.values():
        fill_durations(graph, HW)
    every = simulate(kind_programs(traced, RankFrame()))
    graphs = {f"stage {s} kind {k}": traced[kinds.representative(s, k)]
              for s in range(plan.pp) for k in range(kinds.count)}
    symmetric = simulate(kind_programs(graphs, MeshFrame(mesh, kinds)))
    assert symmetric.end_us == pytest.approx(every.end_us, rel=1e-12)
    for rank in range(mesh.world_size):  # each rank's timeline is its kind representative's
        place = list(graphs).index(f"stage {mesh.coordinate(rank).pp} kind {kinds.of(rank)}")
        assert every.ends[rank] == pytest.approx(symmetric.ends[place], rel=1e-12), rank


def test_the_prediction_follows_the_skew():
    """The busiest EP rank computes and moves more than a uniform load's: the step is longer, and the kinds
    of a stage are busy for different times."""
    plan = PLANS[0]
    uniform = TrainPlan(dp=4, ep=2, pp=2, microbatches=2, seq=16)
    predicted = []
    for p in (plan, uniform):
        workload = trace_workload(MOE, p, torch.float32, HW, schedule=False)
        predicted.append(predict_training(workload.probes, workload.source, p, HW,
                                          kind_probes=workload.kind_probes).summary)
    skew, even = predicted
    assert [k["ranks"] for k in skew["rank_kinds"]] == [2, 2] * 2 and even["rank_kinds"][0]["ranks"] == 4
    assert skew["step_s"] > even["step_s"]
    busy = [k["busy_s"] for k in skew["rank_kinds"] if k["stage"] == 0]
    assert busy[0] > busy[1]  # EP rank 0 holds the busiest experts
