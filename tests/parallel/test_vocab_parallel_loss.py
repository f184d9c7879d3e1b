"""The vocabulary-parallel loss: a real TP2 (and TP2 + SP) step on gloo ranks equals one process, and the
symbolic trace of a TP step has Megatron's three [s, b] all-reduces instead of an all-gather of the logits."""
import dataclasses
import json

import pytest
import torch
from conftest import tiny_config
from plan_steps import global_batch, reference_step

from syntorch.parallel.plans import TrainPlan
from syntorch.parallel.tensor import padded_vocab
from syntorch.trace.training import trace_stage

CONFIG = tiny_config("gpt2", vocab_size=200)  # padded to 256 at TP 2: rank 1 holds 56 padding rows
BERT = tiny_config("bert-base-uncased", vocab_size=200)  # its head has a bias, sharded like the rows
RUNS = {"gpt2": (CONFIG, False), "gpt2 sp": (CONFIG, True), "bert": (BERT, False)}
PLAN = TrainPlan(tp=2, microbatches=2, micro_batch_size=2, seq=16, lr=1e-2)


def real_rank(out_dir: str) -> None:
    """The RUNS' TP2 steps; loss and largest gradient error to out_dir/rank{r}.json."""
    from syntorch.parallel import plans
    from syntorch.parallel.launch import init_distributed
    from syntorch.parallel.mesh import init_groups
    from syntorch.parallel.tensor import take_shard

    rank, world = init_distributed("cpu")
    groups = init_groups(PLAN.mesh)
    results = {}
    for what, (config, sp) in RUNS.items():
        plan = dataclasses.replace(PLAN, sp=sp)
        x, y = global_batch(config, plan)
        torch.manual_seed(0)
        run = plans.apply_plans(config, plan, groups, "cpu")
        loss = plans.train_step(run, [(x[i:i + 2], y[i:i + 2]) for i in range(0, 4, 2)])
        ref_loss, ref_grads, _ = reference_step(config, plan)
        err = 0.0
        for name, p in run.model.named_parameters():
            module, _, param = name.rpartition(".")
            style = run.tp_plan.styles.get(module, "replicated")
            want = take_shard(style, param, ref_grads[name], rank, plan.tp, run.tp_plan.padded_vocab, config.d_head)
            err = max(err, (p.grad - want).abs().max().item())
        results[what] = {"loss": loss.item(), "ref_loss": ref_loss, "grad_err": err}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)


def test_real_tp2_step_with_the_vocab_parallel_loss_equals_one_process(tmp_path, one_thread):
    from syntorch.parallel.launch import spawn

    spawn(real_rank, 2, (str(tmp_path),))
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(results) == set(RUNS)
        for what, r in results.items():
            assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5), f"{what} rank {rank}: {r}"
            assert r["grad_err"] < 1e-5, f"{what} rank {rank}: {r}"


@pytest.mark.parametrize("sp", [False, True])
def test_a_tp_step_all_reduces_three_sb_tensors_and_gathers_no_logits(sp):
    plan = dataclasses.replace(PLAN, sp=sp)
    graph = trace_stage(CONFIG, plan, 0)
    tokens = plan.micro_batch_size * plan.seq
    vocab_bytes = padded_vocab(CONFIG.vocab_size, plan.tp) // plan.tp * 4  # one token's local fp32 logits
    collectives = [d for _, d in graph.collectives()]
    assert all(d["bytes"] < tokens * vocab_bytes for d in collectives)  # no logits cross ranks, local or whole
    assert not [d for d in collectives if d["module"] == "lm_head" and d["phase"] == "forward" and not sp]
    loss = [(d["phase"], d["collective"], d["reduce_op"], d["bytes"]) for d in collectives if d["module"] == "loss"]
    # per micro-batch: the max, the target logit, the sum of exponentials, each one fp32 value per token
    assert loss == [("forward", "all_reduce", op, tokens * 4) for op in ("max", "sum", "sum")] * plan.microbatches


def test_pipelined_inference_still_gathers_the_logits():
    plan = dataclasses.replace(PLAN, mode="infer")
    graph = trace_stage(CONFIG, plan, 0)
    tokens = plan.micro_batch_size * plan.seq
    gathers = [d for _, d in graph.collectives() if d["module"] == "lm_head" and d["collective"] == "all_gather"]
    assert [d["bytes"] for d in gathers] == [tokens * padded_vocab(CONFIG.vocab_size, plan.tp) * 4] * plan.microbatches
