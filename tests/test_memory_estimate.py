"""The per-rank memory estimate (parallel/memory.py) against a real CPU step's peak, and the device check."""
import itertools

import pytest
import torch
from conftest import tiny_config

from syntorch.errors import UserError
from syntorch.parallel import memory
from syntorch.parallel.plans import TrainPlan

CONFIG = tiny_config("gpt2", n_layer=4, n_positions=256, vocab_size=128)


def measured_peak(plan: TrainPlan) -> tuple[int, int]:
    """(peak bytes, bytes held before the step) of a real single-process CPU step. torch keeps no CPU memory
    statistics, so the profiler's memory timeline is replayed (every allocation and free of a tensor storage,
    in order; torch.profiler's export_memory_timeline reads the same), on top of what exists before the step:
    the parameters and AdamW's moments (apply_plans creates them; its 4-byte step counters left out)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    from syntorch.parallel import plans
    from syntorch.parallel.comm import symbolic_world
    from syntorch.parallel.mesh import init_groups

    with symbolic_world(0, 1):
        run = plans.apply_plans(CONFIG, plan, init_groups(plan.mesh), "cpu")
        before = sum(t.untyped_storage().nbytes() for t in itertools.chain(
            run.model.parameters(), (v for state in run.optimizer.state.values() for k, v in state.items() if k != "step")))
        tokens = torch.randint(0, CONFIG.vocab_size, (plan.micro_batch_size, plan.seq))
        batches = [(tokens.clone(), tokens.clone()) for _ in range(plan.microbatches)]
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
            plans.train_step(run, batches)
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return before + peak, before


TOLERANCE = 0.15  # the estimate leaves out backward's transient buffers and small tensors (biases' grads, stats)


@pytest.mark.parametrize("schedule,microbatches", [("1f1b", 3), ("gpipe", 3)])
def test_estimate_within_tolerance_of_a_real_step_peak(schedule, microbatches):
    plan = TrainPlan(microbatches=microbatches, micro_batch_size=4, seq=256, schedule=schedule)
    est = memory.estimate(CONFIG, plan, torch.float32, 0)
    peak, before = measured_peak(plan)
    assert est["weights"] + est["optimizer"] == before  # counted exactly
    print(schedule, est, peak)
    assert abs(est["total"] - peak) <= TOLERANCE * peak, (est, peak)


def test_in_flight_microbatches_follow_the_schedule():
    plan = TrainPlan(pp=4, microbatches=8, seq=16)
    assert [memory.peak_in_flight(plan, s) for s in range(4)] == [4, 3, 2, 1]
    gpipe = TrainPlan(pp=4, microbatches=8, seq=16, schedule="gpipe")
    assert memory.peak_in_flight(gpipe, 2) == 8
    interleaved = TrainPlan(pp=4, microbatches=8, seq=16, virtual_stages=2)
    assert memory.peak_in_flight(interleaved, 0) == (4 - 1) * 2 + 4 + 1  # chunk-micro-batches, half the layers each


def test_tp_sp_and_zero_divide_what_they_shard():
    config = tiny_config("gpt2", n_layer=4, vocab_size=256)
    base = memory.estimate(config, TrainPlan(seq=64), torch.bfloat16, 0)
    sp = memory.estimate(config, TrainPlan(tp=4, sp=True, seq=64), torch.bfloat16, 0)
    assert sp["weights"] < base["weights"] / 3  # all but the layer norms and biases of the row-parallel linears
    layer = {kw: memory.layer_activation_bytes(config, TrainPlan(seq=64, **dict(kw)), 2)
             for kw in ((), (("tp", 4),), (("tp", 4), ("sp", True)))}
    assert layer[()] == 16 * 2 * 64 * config.d_model  # Korthikanti's 34·s·b·h less dropout masks, fused attention
    assert layer[(("tp", 4),)] == (4 + 12 / 4) * 2 * 64 * config.d_model  # his 10 + 24/t, less the masks
    assert layer[(("tp", 4), ("sp", True))] == layer[()] / 4
    n = base["weights"] / 2  # bf16
    assert base["optimizer"] == 12 * n  # FP32 master and two FP32 moments
    zero = memory.estimate(config, TrainPlan(dp=4, zero=1, seq=64), torch.bfloat16, 0)
    assert zero["optimizer"] == pytest.approx((12 + 2) * n / 4, rel=1e-6)  # those and the bf16 shard, 1/4 each


def test_estimate_over_the_device_is_one_line():
    from syntorch.config import get_config
    from syntorch.hardware import load_hw_config
    from syntorch.workload import trace_workload

    plan = TrainPlan(pp=2, microbatches=2, seq=2048)
    with pytest.raises(UserError, match=r"stage 0 needs an estimated \d+\.\d GB per rank but a100-80gb has 80 GB") as e:
        trace_workload(get_config("gpt3-175b"), plan, torch.bfloat16, load_hw_config("a100-80gb"))
    assert "\n" not in str(e.value) and "raise --tp/--pp" in str(e.value)
