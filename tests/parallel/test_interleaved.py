"""Interleaved 1F1B (virtual pipeline stages): the schedule itself, real gloo runs against one process, and
symbolic traces (replicated from a probe, derived by shifting) against running every step."""
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from plan_steps import microbatches

from syntorch.errors import UserError
from syntorch.parallel.pipeline import schedule, stage_chunks
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.step_schedule import schedule_stage
from syntorch.trace.training import probe_stage, shift_stage, trace_stage, traced_stage_for


def depends_on(step, stage, pp, virtual):
    """What (stage, step) must have run before `step` on `stage`: the activation it receives, the gradient
    it receives (or, for the loss chunk, its own forward)."""
    kind, m, c = step
    if kind == "F":
        return [(stage - 1, ("F", m, c))] if stage else ([(pp - 1, ("F", m, c - 1))] if c else [])
    if stage < pp - 1:
        return [(stage + 1, ("B", m, c))]
    return [(0, ("B", m, c + 1))] if c < virtual - 1 else [(stage, ("F", m, c))]


def run_schedule(pp, microbatches, virtual, t_f=1.0, t_b=2.0, kind="1f1b"):
    """Every stage runs its list in order, a step as soon as what it depends on is done (sends never block,
    as gloo's do not); a chunk's step takes 1/V of a stage's. Returns (every step ran, step time)."""
    orders = [schedule(kind, s, pp, microbatches, virtual) for s in range(pp)]
    done, position, clock = {}, [0] * pp, [0.0] * pp
    moved = True
    while moved:
        moved = False
        for s in range(pp):
            while position[s] < len(orders[s]):
                step = orders[s][position[s]]
                needs = depends_on(step, s, pp, virtual)
                if not all(n in done for n in needs):
                    break
                clock[s] = max([clock[s], *(done[n] for n in needs)]) + (t_f if step[0] == "F" else t_b) / virtual
                done[s, step] = clock[s]
                position[s] += 1
                moved = True
    return all(position[s] == len(orders[s]) for s in range(pp)), max(clock)


@pytest.mark.parametrize("pp,microbatches,virtual", [(4, 8, 2), (4, 4, 2), (2, 6, 3), (4, 16, 4), (8, 16, 2)])
def test_interleaved_steps_once_in_dependency_order_with_bubble_shrunk_by_v(pp, microbatches, virtual):
    for stage in range(pp):
        steps = schedule("1f1b", stage, pp, microbatches, virtual)
        assert sorted(steps) == sorted((k, m, c) for k in "FB" for m in range(microbatches) for c in range(virtual))
        assert all(steps.index(("F", m, c)) < steps.index(("B", m, c))
                   for m in range(microbatches) for c in range(virtual))
        # in flight: Megatron's warm-up forwards plus the one of the first 1F1B pair (all when M == pp)
        alive = max(sum(k == "F" for k, _, _ in steps[:i + 1]) - sum(k == "B" for k, _, _ in steps[:i + 1])
                    for i in range(len(steps)))
        warmup = (pp - stage - 1) * 2 + (virtual - 1) * pp
        assert alive == (microbatches * virtual if microbatches == pp else min(warmup + 1, microbatches * virtual))
    finished, step_time = run_schedule(pp, microbatches, virtual)
    assert finished  # no stage waits for a step that waits for it
    # Narayanan et al. 2021: the bubble is (p - 1)(t_f + t_b) / V
    assert step_time == pytest.approx(microbatches * 3.0 + (pp - 1) * 3.0 / virtual)
    assert run_schedule(pp, microbatches, 1)[1] == pytest.approx(microbatches * 3.0 + (pp - 1) * 3.0)


def test_chunks_are_dealt_round_robin():
    assert stage_chunks(8, 2, 2) == [(range(0, 2), range(4, 6)), (range(2, 4), range(6, 8))]
    assert stage_chunks(12, 2, 3)[1] == (range(2, 4), range(6, 8), range(10, 12))
    assert stage_chunks(5, 2, 1) == [(range(0, 3),), (range(3, 5),)]


@pytest.mark.parametrize("kwargs,n_layer,message", [
    (dict(pp=2, virtual_stages=2, microbatches=4), 6, "--virtual_stages 2 must divide the layers per stage: "
                                                      "6 layers over --pp 2 is 3 per stage"),
    (dict(pp=2, virtual_stages=2, microbatches=4), 5, "5 layers over --pp 2 is 2.5 per stage"),
    (dict(pp=2, virtual_stages=2, microbatches=3), 8, "--microbatches 3 must be a multiple of --pp 2"),
    (dict(pp=1, virtual_stages=2), 8, "it needs --pp > 1"),
    (dict(pp=2, virtual_stages=0, microbatches=2), 8, "--virtual_stages must be at least 1"),
    (dict(pp=2, virtual_stages=2, microbatches=2, mode="infer"), 8, "drop it with --mode infer"),
])
def test_bad_interleaving_is_one_line(kwargs, n_layer, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")) as e:
        TrainPlan(seq=16, **kwargs).check(tiny_config("gpt2", n_layer=n_layer))
    assert "\n" not in str(e.value)


# --- symbolic traces ---------------------------------------------------------------------------------------

CONFIG = tiny_config("gpt2", n_layer=8, vocab_size=200)


@pytest.mark.parametrize("plan", [
    TrainPlan(pp=2, virtual_stages=2, microbatches=6, seq=16),
    TrainPlan(dp=2, tp=2, pp=2, sp=True, zero=2, bucket_mb=0.02, virtual_stages=2, microbatches=4, seq=16),
])
def test_interleaved_trace_replicated_from_a_probe_equals_running_every_step(plan):
    for stage in range(plan.pp):
        replicated, ran = trace_stage(CONFIG, plan, stage), trace_stage(CONFIG, plan, stage, replicate=False)
        sends = [d for _, d in ran.collectives() if d["collective"] == "send"]
        assert len(sends) == 2 * plan.microbatches * plan.virtual_stages - plan.microbatches  # all but the loss chunk's
        assert len({d["tag"] for d in sends}) == len(sends)  # one tag per message
        assert dict(replicated.nodes(data=True)) == dict(ran.nodes(data=True))
        assert list(replicated.edges(data=True)) == list(ran.edges(data=True))
        assert replicated.graph == ran.graph
        assert ran.graph["pipeline_schedule"][:2] == ["F0.0", "F1.0"]


def test_interleaved_middle_stage_derived_by_shifting_equals_tracing_it():
    plan = TrainPlan(pp=4, virtual_stages=2, microbatches=4, seq=16)
    config = tiny_config("gpt2", n_layer=16, vocab_size=200)
    assert traced_stage_for(config, plan) == [0, 1, 1, 3]
    probe, blocks = probe_stage(config, plan, 1)
    derived = schedule_stage(shift_stage(probe, plan.mesh, 2, 2), blocks, plan)
    traced = trace_stage(config, plan, 2, replicate=False)
    assert dict(derived.nodes(data=True)) == dict(traced.nodes(data=True))
    assert list(derived.edges(data=True)) == list(traced.edges(data=True))
    # stage 2 holds chunks 2 and 6 of 8: layers 4, 5 and 12, 13
    assert {d["module"].split(".")[1] for _, d in traced.ops() if d["module"].startswith("layers.")} == \
        {"4", "5", "12", "13"}


def test_interleaved_workload_validates(tmp_path):
    from syntorch.chakra.validator import check_traces
    from syntorch.workload import trace_workload, write_workload

    plan = TrainPlan(dp=2, tp=2, pp=2, virtual_stages=2, microbatches=4, seq=16)
    write_workload(trace_workload(CONFIG, plan, torch.float32), tmp_path, level="op", progress=False)
    check_traces(tmp_path)


# --- real runs ---------------------------------------------------------------------------------------------

REAL = TrainPlan(pp=2, virtual_stages=2, microbatches=4, micro_batch_size=2, seq=16, lr=1e-2)


def batches(plan):
    return microbatches(CONFIG, plan)


def real_rank(out_dir: str) -> None:
    from syntorch.parallel import plans
    from syntorch.parallel.launch import init_distributed
    from syntorch.parallel.mesh import init_groups

    rank, _ = init_distributed("cpu")
    groups = init_groups(REAL.mesh, CONFIG.tied_head)
    torch.manual_seed(0)
    run = plans.apply_plans(CONFIG, REAL, groups, "cpu")
    loss = plans.train_step(run, batches(REAL))
    result = {"loss": None if loss is None else loss.item(),
              "grads": {n: p.grad.tolist() for n, p in run.model.named_parameters()}}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def test_real_interleaved_step_equals_one_process(tmp_path):
    from syntorch.models import build_model
    from syntorch.parallel.launch import spawn

    spawn(real_rank, 2, (str(tmp_path),))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    torch.manual_seed(0)
    model = build_model(CONFIG, "cpu").train()
    x, y = (torch.cat(parts) for parts in zip(*batches(REAL)))
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), REAL.clip_grad)  # the step clips by the global norm
    assert ranks[0]["loss"] is None and ranks[1]["loss"] == pytest.approx(loss.item(), abs=1e-5)
    grads = dict(model.named_parameters())
    # stage 0 holds layers 0, 1, 4, 5 (and the embeddings), stage 1 layers 2, 3, 6, 7 (and the head)
    assert {n.split(".")[1] for n in ranks[0]["grads"] if n.startswith("layers.")} == {"0", "1", "4", "5"}
    for r in ranks:
        for name, grad in r["grads"].items():
            ref = grads["tok_emb.weight" if name == "lm_head.weight" else name].grad
            torch.testing.assert_close(torch.tensor(grad), ref, rtol=1e-4, atol=1e-5, msg=name)
