"""Expert parallelism: the mesh's EP groups, a real EP 2 step against one process, symbolic all-to-alls and
their Chakra files."""
import json

import pytest
import torch
from conftest import tiny_config
from plan_steps import global_batch, reference_step

from syntorch.cli import main
from syntorch.chakra.validator import check_traces
from syntorch.config import save_model_config
from syntorch.errors import UserError
from syntorch.parallel.mesh import Mesh
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.training import trace_stage

MOE = tiny_config("gpt2", n_layer=2, vocab_size=200, n_experts=4, moe_top_k=2)


def test_ep_groups_split_dp_and_translation_keeps_them():
    mesh = Mesh(dp=4, pp=2, tp=2, ep=2)
    ep = mesh.groups("ep")
    assert ep[0] == [0, 4] and [8, 12] in ep  # dp indices 0,1 then 2,3 (tp 0, stage 0)
    assert [0, 8] in mesh.groups("expert_dp") and [4, 12] in mesh.groups("expert_dp")
    for kind in ("ep", "expert_dp", "dp", "tp"):
        groups = {tuple(g) for g in mesh.groups(kind)}
        for to in range(mesh.world_size):
            for g in mesh.groups(kind):
                assert tuple(sorted(mesh.translate(r, to) for r in g)) in groups, (kind, g, to)


@pytest.mark.parametrize("bad, words", [(dict(dp=2, ep=3), "must divide --dp"),
                                        (dict(dp=4, ep=4), "must divide the 6 experts"),
                                        (dict(dp=2, ep=2, dense=True), "has none")])
def test_bad_expert_parallel_degrees(bad, words):
    dense = bad.pop("dense", False)
    config = tiny_config("gpt2") if dense else tiny_config("gpt2", n_experts=6)
    with pytest.raises(UserError, match=words):
        TrainPlan(seq=16, **bad).check(config)


def test_symbolic_all_to_alls_carry_the_routed_rows():
    plan = TrainPlan(dp=2, ep=2, seq=16, micro_batch_size=2)
    graph = trace_stage(MOE, plan, 0)
    a2a = [d for _, d in graph.collectives() if d["collective"] == "all_to_all"]
    rows = plan.micro_batch_size * plan.seq * MOE.moe_top_k  # (token, slot) pairs, all sent somewhere
    by_phase = {}
    for d in a2a:
        by_phase.setdefault(d["phase"], []).append(d["bytes"])
    # per layer, forward: the counts, the rows out and back; backward: the gradients of both row exchanges
    row_bytes = rows * MOE.d_model * 4
    assert sorted(by_phase["forward"]) == sorted([4 * 8] * 2 + [row_bytes] * 4)
    assert sorted(by_phase["backward"]) == [row_bytes] * 4
    assert all(d["group"] == [0, 1] for d in a2a)
    # expert-DP has one rank here (ep = dp): only the dense parameters are all-reduced, over DP
    from syntorch.models import build_model
    dense = sum(p.numel() * 4 for n, p in build_model(MOE, "meta").named_parameters() if ".experts." not in n)
    reduced = [d for _, d in graph.collectives() if d["collective"] == "all_reduce"]
    assert sum(d["bytes"] for d in reduced if d["phase"] == "backward") == dense
    # and the gradient norm's, over every rank: the experts differ between the EP ranks (parallel/clip.py)
    assert [(d["group"], d["bytes"]) for d in reduced if d["phase"] == "optimizer"] == [([0, 1], 4)]


EP2 = TrainPlan(dp=2, ep=2, microbatches=2, micro_batch_size=2, seq=8, lr=1e-2)


def ep_rank(out_dir: str, config=MOE) -> None:
    from syntorch.parallel import plans
    from syntorch.parallel.launch import init_distributed
    from syntorch.parallel.mesh import init_groups

    rank, _ = init_distributed("cpu")
    plan = EP2
    torch.manual_seed(0)
    run = plans.apply_plans(config, plan, init_groups(plan.mesh, config.tied_head), "cpu")
    x, y = global_batch(config, plan)
    mine = [(x[i:i + 2], y[i:i + 2]) for i in range(rank * 4, rank * 4 + 4, 2)]
    loss = plans.train_step(run, mine)
    first = next(m.first_expert for m in run.model.modules() if hasattr(m, "first_expert"))
    grads = {}
    for name, p in run.model.named_parameters():
        if ".experts." in name:  # local index -> the expert's global index
            head, _, tail = name.partition(".experts.")
            local, _, rest = tail.partition(".")
            name = f"{head}.experts.{first + int(local)}.{rest}"
        grads[name] = p.grad.tolist()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"loss": loss.item(), "grads": grads}, f)


def test_real_ep2_step_equals_one_process(tmp_path):
    from syntorch.parallel.launch import spawn

    spawn(ep_rank, 2, (str(tmp_path),))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    ref_loss, ref_grads, _ = reference_step(MOE, EP2)
    assert (ranks[0]["loss"] + ranks[1]["loss"]) / 2 == pytest.approx(ref_loss, abs=1e-5)
    experts_seen = set()
    for name, grad in ref_grads.items():
        holders = [r["grads"][name] for r in ranks if name in r["grads"]]
        assert holders, name
        if ".experts." in name:
            assert len(holders) == 1  # each expert lives on one EP rank
            experts_seen.add(name.split(".experts.")[1].split(".")[0])
        for g in holders:
            torch.testing.assert_close(torch.tensor(g), grad, atol=1e-5, rtol=1e-4)
    assert experts_seen == {"0", "1", "2", "3"}


def test_trace_command_writes_all_to_alls_that_validate(tmp_path):
    config = tmp_path / "moe.json"
    save_model_config(MOE, config)
    out = tmp_path / "run"
    assert main(["trace", "--model_config", str(config), "--dp", "4", "--ep", "2", "--tp", "2", "--pp", "2",
                 "--microbatches", "2", "--seq", "16", "--out", str(out), "--no_progress"]) == 0
    assert check_traces(out)[0] == []
    groups = {tuple(g) for g in json.loads((out / "comm_groups.json").read_text()).values()}
    assert (0, 4) in groups and (8, 12) in groups and (0, 8) in groups  # EP pairs and expert-DP pairs
