"""Mixed-precision training (parallel/precision.py): FP32 masters in the optimizer, the model in bf16/fp16,
checked on a real CPU run against FP32 and in the symbolic trace."""
import pytest
import torch
from conftest import tiny_config

from syntorch.parallel.plans import TrainPlan
from syntorch.parallel.precision import LossScaler
from syntorch.trace.training import trace_stage

CONFIG = tiny_config("gpt2", n_layer=2, vocab_size=200)
PLAN = TrainPlan(microbatches=2, micro_batch_size=4, seq=32, lr=3e-3)


def losses(dtype, steps=6, poison=None):
    """Losses of `steps` real CPU steps on one process from the same initial weights and data; `poison`:
    a step whose gradients are made infinite before the optimizer runs."""
    from syntorch.parallel import plans
    from syntorch.parallel.distributed import symbolic_world
    from syntorch.parallel.mesh import init_groups

    torch.manual_seed(0)
    tokens = torch.randint(0, CONFIG.vocab_size, (PLAN.microbatches * PLAN.micro_batch_size, PLAN.seq + 1),
                           generator=torch.Generator().manual_seed(1))
    b = PLAN.micro_batch_size
    batches = [(tokens[i:i + b, :-1], tokens[i:i + b, 1:]) for i in range(0, len(tokens), b)]
    out = []
    with symbolic_world(0, 1):
        run = plans.apply_plans(CONFIG, PLAN, init_groups(PLAN.mesh), "cpu", dtype)
        if dtype == torch.float16:  # Megatron's 2**32 overflows fp16 for the first steps, until backed off
            run.precision.scaler.scale = 2.0 ** 10
        for step in range(steps):
            for p in run.model.parameters():
                p.grad = None
            hook = run.model.tok_emb.weight.register_hook(lambda g: torch.full_like(g, float("inf"))) \
                if step == poison else None
            out.append(plans.train_step(run, batches).item())
            if hook:
                hook.remove()
    return out, run


def test_bf16_with_fp32_masters_tracks_fp32():
    fp32, _ = losses(torch.float32)
    bf16, run = losses(torch.bfloat16)
    assert fp32[-1] < fp32[0] - 0.05  # it learns, so tracking it means something
    # bf16 keeps 8 bits of mantissa: the losses agree to about 1%
    assert bf16 == pytest.approx(fp32, rel=0.01)
    assert {p.dtype for p in run.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in run.optimizer.param_groups[0]["params"]} == {torch.float32}
    assert all(s["exp_avg"].dtype == torch.float32 for s in run.optimizer.state.values())
    for p, master in zip(run.model.parameters(), run.precision.masters):  # weights are the masters, cast
        assert torch.equal(p, master.to(torch.bfloat16))


def test_fp16_skips_a_step_with_infinite_gradients_and_backs_off():
    scaler = LossScaler(scale=8.0, hysteresis=2, growth_interval=3)
    for finite, scale in [(False, 8.0), (False, 4.0), (True, 4.0), (True, 4.0), (True, 8.0)]:
        scaler.update(finite)
        assert scaler.scale == scale
    clean, _ = losses(torch.float16, steps=3)
    poisoned, run = losses(torch.float16, steps=3, poison=1)
    assert poisoned[:2] == clean[:2]  # the poisoned step's loss is computed before its update
    assert clean[2] < clean[1]  # the clean run's second update was taken
    assert poisoned[2] == poisoned[1]  # the poisoned one was skipped: the weights are as before it
    assert run.precision.scaler.bad_steps == 1 and run.precision.scaler.scale == 2.0 ** 10  # once: no backoff yet


def test_trace_casts_to_fp32_masters_and_reduces_in_the_model_dtype():
    graph = trace_stage(CONFIG, TrainPlan(dp=2, seq=16), 0, torch.bfloat16)
    weights = {d["name"]: d for _, d in graph.tensors() if d.get("is_param") and d["version"] == 0}
    assert {d["dtype"] for d in weights.values()} == {"bfloat16"}
    model_bytes = sum(d["bytes"] for d in weights.values())
    reduced = sum(d["bytes"] for _, d in graph.collectives() if d["collective"] == "all_reduce")
    assert reduced == model_bytes  # DP gradients in bf16 (see precision.py for Megatron's choice)
    optimizer = [d for _, d in graph.ops() if d["phase"] == "optimizer"]
    cast = next(d for d in optimizer if d["name"] == "aten._foreach_copy_")  # one multi-tensor cast
    assert cast["bytes_written"] == 2 * model_bytes  # each gradient to FP32 for its master
    lerp, = [d for d in optimizer if d["name"] == "aten._foreach_lerp_"]
    assert lerp["bytes_written"] == 2 * model_bytes  # AdamW's first moment, FP32 like the masters
    copy_back = [d for d in optimizer if d["name"] == "aten._foreach_copy_"]
    assert copy_back and copy_back[-1]["bytes_written"] == model_bytes  # masters cast into the weights
