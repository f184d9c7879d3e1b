"""Data parallelism and ZeRO in training traces, and one real DP2 x TP2 training step on gloo ranks."""
import json

import pytest
import torch
from conftest import tiny_config
from plan_steps import global_batch, reference_step

from syntorch.parallel.buckets import make_buckets
from syntorch.parallel.plans import TrainPlan
from syntorch.parallel.tensor import padded_vocab
from syntorch.trace.training import trace_stage

CONFIG = tiny_config("gpt2", n_layer=4, vocab_size=200)


def stage_param_bytes(c, plan, stage: int) -> int:
    """Parameter bytes of one rank of `stage`, from the config: Megatron's shards, fp32."""
    d, ff, tp = c.d_model, c.d_ff, plan.tp
    layer = 2 * d + (3 * d * d + 3 * d) // tp + d * d // tp + d + 2 * d + (d * ff + ff) // tp + ff * d // tp + d
    layers = len(plan.stage(c, stage).layers)
    embedding = padded_vocab(c.vocab_size, tp) // tp * d  # tied: the first stage's, and the last stage's copy
    ends = embedding + c.n_positions * d if stage == 0 else embedding + 2 * d  # positions / ln_f
    return 4 * (layers * layer + ends)


def dp_collectives(graph, plan, kind):
    rep = graph.graph["rank"]
    group = plan.mesh.group(rep, "dp")
    return [(n, d) for n, d in graph.collectives() if d["group"] == group and d["collective"] == kind]


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_gradient_bytes_synchronised_per_dp_group_equal_the_stage_parameter_bytes(zero):
    plan = TrainPlan(dp=2, tp=2, pp=2, zero=zero, bucket_mb=0.02, microbatches=2, seq=16)
    for stage in range(2):
        graph = trace_stage(CONFIG, plan, stage)
        reduced = dp_collectives(graph, plan, "reduce_scatter" if zero else "all_reduce")
        assert sum(d["bytes"] for _, d in reduced) == stage_param_bytes(CONFIG, plan, stage)
        assert len(reduced) > 2  # the 20 KiB buckets split the stage
        assert all(d["phase"] == "backward" for _, d in reduced)
        gathered = dp_collectives(graph, plan, "all_gather")
        assert sum(d["bytes"] for _, d in gathered) == (stage_param_bytes(CONFIG, plan, stage) if zero else 0)
        assert all(d["phase"] == "optimizer" for _, d in gathered)
        # buckets overlap backward (launched before its last layer op) except under ZeRO-1
        last_layer_op = max(n for n, d in graph.ops() if d["phase"] == "backward" and d["module"].startswith("layers."))
        assert (min(n for n, _ in reduced) < last_layer_op) == (zero != 1)


def test_buckets_fill_in_reverse_order_up_to_the_cap():
    params = [torch.nn.Parameter(torch.empty(n, device="meta")) for n in (10, 20, 30, 40, 5)]
    buckets = make_buckets(params, bucket_bytes=4 * 45, pad_to=4)
    assert [[p.numel() for p in b.params] for b in buckets] == [[5, 40], [30], [20, 10]]
    assert [b.size for b in buckets] == [48, 32, 32]  # padded to a multiple of dp under ZeRO


def test_optimizer_updates_each_ranks_zero_shard():
    plan = TrainPlan(dp=2, zero=1, bucket_mb=0.02, seq=16)
    graph = trace_stage(CONFIG, plan, 0)
    adam = [d for _, d in graph.ops() if d["phase"] == "optimizer" and d["name"] == "aten._foreach_lerp_"]
    assert len(adam) == 1  # one multi-tensor update of the exp_avg of every shard
    shards = dp_collectives(graph, plan, "reduce_scatter")
    assert adam[0]["bytes_written"] == sum(d["bytes"] for _, d in shards) // plan.dp


# --- a real step: DP2 x TP2 on four gloo ranks against one process -----------------------------------------

REAL = TrainPlan(dp=2, tp=2, microbatches=2, micro_batch_size=2, seq=16, lr=1e-2)


def real_rank(out_dir: str) -> None:
    """DDP and ZeRO-1 steps on this rank from the same initial weights; results to out_dir/rank{r}.json."""
    import dataclasses

    from syntorch.parallel import plans
    from syntorch.parallel.launch import init_distributed
    from syntorch.parallel.mesh import init_groups
    from syntorch.trace.tracer import Tracer

    rank, world = init_distributed("cpu")
    groups = init_groups(REAL.mesh, CONFIG.tied_head)
    results = {}
    for zero in ZEROS:
        plan = dataclasses.replace(REAL, zero=zero)
        torch.manual_seed(0)
        run = plans.apply_plans(CONFIG, plan, groups, "cpu")
        with Tracer(run.model, rank=rank, world_size=world, default_phase=None) as tracer:
            loss = plans.train_step(run, my_batches(plan, rank), tracer.phase)
        results[zero] = {"loss": loss.item(), **errors_against_reference(run, plan, rank),
                         "collectives": [[d["collective"], d["group"], d["bytes"], d["phase"]]
                                         for _, d in tracer.graph.collectives()]}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)


def my_batches(plan, rank):
    x, y = global_batch(CONFIG, plan)
    n, b = plan.microbatches * plan.micro_batch_size, plan.micro_batch_size
    dp_idx = plan.mesh.coordinate(rank).dp
    return [(x[i:i + b], y[i:i + b]) for i in range(dp_idx * n, (dp_idx + 1) * n, b)]


def errors_against_reference(run, plan, rank) -> dict:
    """Largest difference of this rank's gradients and updated parameters from the reference's shards.
    Parameters are compared where the gradient is not tiny: Adam's first step is g / (|g| + eps), which a
    1e-7 difference in a 1e-8 gradient flips; everywhere they must move by at most the learning rate."""
    from syntorch.parallel.tensor import take_shard

    ref_loss, ref_grads, ref_params = reference_step(CONFIG, plan)
    tp_rank = plan.mesh.coordinate(rank).tp

    def shard(name, full):
        module, _, param = name.rpartition(".")
        style = run.tp_plan.styles.get(module, "replicated")
        return take_shard(style, param, full.detach(), tp_rank, plan.tp, run.tp_plan.padded_vocab, CONFIG.d_head)

    grad_err = param_err = step_excess = 0.0
    names = {id(p): n for n, p in run.model.named_parameters()}
    if plan.zero:  # this rank's part of each bucket, one after the other in the flat shard
        mine = []
        for bucket in run.grad_sync.all_buckets:
            flat = torch.cat([shard(names[id(p)], ref_grads[names[id(p)]]).flatten() for p in bucket.params])
            flat = torch.cat([flat, flat.new_zeros(bucket.size - flat.numel())])
            mine.append(flat.chunk(plan.dp)[plan.mesh.coordinate(rank).dp])
        grad_err = (run.grad_sync.shard.grad - torch.cat(mine)).abs().max().item()
    for name, p in run.model.named_parameters():
        g, new = shard(name, ref_grads[name]), shard(name, ref_params[name])
        if not plan.zero:
            grad_err = max(grad_err, (p.grad - g).abs().max().item())
        diff = (p.detach() - new).abs()
        param_err = max(param_err, diff[g.abs() > 1e-3].max().item() if (g.abs() > 1e-3).any() else 0.0)
        step_excess = max(step_excess, diff.max().item() - 2 * plan.lr)
    return {"ref_loss": ref_loss, "grad_err": grad_err, "param_err": param_err, "step_excess": step_excess}


ZEROS = (0, 1)


def test_real_dp2_tp2_step_equals_one_process_and_the_symbolic_trace(tmp_path):
    import dataclasses

    from syntorch.parallel.launch import spawn

    spawn(real_rank, 4, (str(tmp_path),))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for zero in ZEROS:
        ranks = [r[str(zero)] for r in results]
        # each DP replica's loss is the mean over its half of the batch; their mean is the global mean
        assert (ranks[0]["loss"] + ranks[2]["loss"]) / 2 == pytest.approx(ranks[0]["ref_loss"], abs=1e-5)
        plan = dataclasses.replace(REAL, zero=zero)
        for rank, r in enumerate(ranks):
            assert r["grad_err"] < 1e-5 and r["param_err"] < 1e-5, f"zero {zero} rank {rank}: {r}"
            assert r["step_excess"] <= 0
            symbolic = trace_stage(CONFIG, plan, 0, torch.float32, rank=rank)
            assert r["collectives"] == [[d["collective"], d["group"], d["bytes"], d["phase"]]
                                        for _, d in symbolic.collectives()]
