"""One rank assembly (parallel/assemble.py) for every caller: inference (spec.load_model), training
(plans.apply_plans) and the memory estimate get the same model on each rank of TP2 x PP2 and of EP2 (gloo,
real values), and each stage's output equals the one-process model's."""
import copy

import pytest
import torch
from conftest import tiny_config

from syntorch.inference.spec import InferenceSpec, load_model
from syntorch.models import build_model
from syntorch.parallel import memory
from syntorch.parallel.assemble import RankPlan, assemble_rank
from syntorch.parallel.launch import init_distributed, spawn
from syntorch.parallel.mesh import init_groups
from syntorch.parallel.pipeline import split_stage, stage_forward
from syntorch.parallel.plans import TrainPlan, apply_plans

GPT = tiny_config("gpt2", n_layer=4)
MOE = tiny_config("gpt2", n_layer=2, n_experts=4, moe_top_k=2)
B, T = 2, 8
# (config, the inference path's plan, the training path's plan)
LAYOUTS = {
    "tp2 pp2": (GPT, RankPlan(tp=2, pp=2, mode="infer"), TrainPlan(tp=2, pp=2, seq=T)),
    "ep2": (MOE, RankPlan(dp=2, ep=2, mode="infer"), TrainPlan(dp=2, ep=2, seq=T)),
}


def counted(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # each tensor once: a tied head is the embedding


def inference_model(config, plan: RankPlan, groups) -> torch.nn.Module:
    """The model `syntorch infer` loads on this rank (spec.load_model), or, for EP, which no inference
    command takes yet, assemble_rank itself under the inference plan."""
    if plan.ep == 1:
        return load_model(InferenceSpec(tp=plan.tp, pp=plan.pp, seed=0), config, groups)
    torch.manual_seed(0)
    return assemble_rank(config, plan, groups, "cpu").model


def stage_input(config, groups, plan) -> torch.Tensor:
    """Stage 0 takes tokens (each DP rank its own); a later stage a stream [B, T, d], the same on its TP ranks."""
    g = torch.Generator().manual_seed(1 + groups.mesh.coordinate(groups.rank).dp)
    if groups.stage == 0:
        return torch.randint(0, config.vocab_size, (B, T), generator=g)
    return torch.randn(B, T, config.d_model, generator=g)


def _rank(layout: str, expected_params: list[int]) -> None:
    config, infer_plan, train_plan = LAYOUTS[layout]
    init_distributed("cpu")
    groups = init_groups(train_plan.mesh, config.tied_head)
    infer = inference_model(config, infer_plan, groups)
    torch.manual_seed(0)
    train = apply_plans(config, train_plan, groups, "cpu").model
    assert [(n, p.shape) for n, p in infer.named_parameters()] == [(n, p.shape) for n, p in train.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(infer.parameters(), train.parameters()))
    assert counted(train) == expected_params[groups.stage]  # memory.py counts the model the rank holds
    torch.manual_seed(0)
    whole = build_model(config)  # the one-process model, cut to the stage
    reference = split_stage(copy.deepcopy(whole), train_plan.stage(config, groups.stage))
    x = stage_input(config, groups, train_plan)
    seq_len = None if groups.stage == 0 else T
    with torch.no_grad():
        outputs = [stage_forward(m, x, seq_len=seq_len) for m in (infer, train, reference)]
    assert torch.equal(outputs[0], outputs[1])
    torch.testing.assert_close(outputs[0], outputs[2], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inference_and_training_assemble_the_same_rank(layout):
    config, _, plan = LAYOUTS[layout]
    params = [memory.stage_params(config, plan, plan.stage(config, s)) for s in range(plan.pp)]
    spawn(_rank, plan.mesh.world_size, (layout, [p.dense + p.experts for p in params]))
