"""FSDP and DP as Llama 3 runs them: `reshard_after_forward=False` (FSDP2's option: layers stay whole from
forward to backward, so backward gathers nothing) and FP32 gradient reduction (`grad_reduce_dtype="fp32"`),
in symbolic traces, in real gloo steps against one process, and in the memory estimate."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from plan_steps import global_batch
from tests.parallel.test_fsdp import errors

from syntorch.models import build_model
from syntorch.parallel import memory
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.training import trace_stage

CONFIG = tiny_config("gpt2", n_layer=4, vocab_size=200)  # test_fsdp's, which `errors` checks against


def gathers(graph, phase: str) -> list[int]:
    return [d["bytes"] for _, d in graph.collectives() if d["collective"] == "all_gather" and d["phase"] == phase]


@pytest.mark.parametrize("plan", [TrainPlan(dp=2, zero=3, microbatches=6, seq=16),
                                  TrainPlan(dp=2, pp=2, zero=3, microbatches=6, seq=16)])
def test_not_resharded_after_forward_backward_gathers_nothing(plan):
    kept = dataclasses.replace(plan, reshard_after_forward=False)
    for stage in range(plan.pp):
        resharded, ran = trace_stage(CONFIG, plan, stage), trace_stage(CONFIG, kept, stage, replicate=False)
        units = len(gathers(resharded, "forward")) // plan.microbatches  # the ends (and a tied weight), layers
        assert len(gathers(resharded, "backward")) == units * plan.microbatches  # resharded: gathered again
        assert gathers(ran, "backward") == []
        # each unit gathered once, by the first forward: whole for the step (its shard is what the optimizer updates)
        assert sorted(gathers(ran, "forward")) == sorted(gathers(resharded, "forward")[:units])
        scatters = [[d["bytes"] for _, d in g.collectives() if d["collective"] == "reduce_scatter"]
                    for g in (resharded, ran)]
        assert scatters[0] == scatters[1]  # every micro-batch still reduce-scatters
        # the step made from a probe (GPipe's order) equals running the schedule: the gathers do not depend on it
        replicated = trace_stage(CONFIG, kept, stage)
        assert dict(replicated.nodes(data=True)) == dict(ran.nodes(data=True))
        assert list(replicated.edges(data=True)) == list(ran.edges(data=True))


@pytest.mark.parametrize("zero,collective", [(0, "all_reduce"), (2, "reduce_scatter"), (3, "reduce_scatter")])
def test_fp32_reduction_moves_four_byte_elements(zero, collective):
    def reduced(dtype_name):
        plan = TrainPlan(dp=2, zero=zero, microbatches=2, seq=16, grad_reduce_dtype=dtype_name)
        graph = trace_stage(CONFIG, plan, 0, torch.bfloat16)
        return [d["bytes"] for _, d in graph.collectives() if d["collective"] == collective and d["phase"] == "backward"]

    model, fp32 = reduced("model"), reduced("fp32")
    assert model and fp32 == [2 * b for b in model]


def test_memory_counts_whole_layers_kept_and_fp32_gradients():
    config = tiny_config("llama-3-8b", n_layer=4, n_kv_head=2)
    base = dict(dp=4, zero=3, seq=16)
    psi = memory.stage_params(config, TrainPlan(**base), TrainPlan(**base).stage(config, 0))
    whole = psi.dense + psi.experts
    default = memory.estimate(config, TrainPlan(**base), torch.bfloat16, 0)
    kept = memory.estimate(config, TrainPlan(**base, reshard_after_forward=False), torch.bfloat16, 0)
    # resharded: the shards and two units whole; kept: the shards and every unit whole (2 bytes each)
    assert default["weights"] == int(2 * (whole / 4 + 2 * psi.largest_unit))
    assert kept["weights"] == int(2 * (whole / 4 + whole))
    fp32 = memory.estimate(config, TrainPlan(**base, grad_reduce_dtype="fp32"), torch.bfloat16, 0)
    assert fp32["gradients"] == 2 * default["gradients"]  # 4-byte gradients instead of bf16's 2
    ddp = [memory.estimate(config, TrainPlan(dp=4, seq=16, grad_reduce_dtype=d), torch.bfloat16, 0)["gradients"]
           for d in ("model", "fp32")]
    assert ddp == [2 * whole, 4 * whole]  # Megatron's FP32 main_grad buffers: 4Ψ


# --- real steps on two gloo ranks against one process ----------------------------------------------------

REAL = {"fsdp_kept": (TrainPlan(dp=2, zero=3, microbatches=2, micro_batch_size=2, seq=16, lr=1e-2,
                                reshard_after_forward=False), torch.float32),
        "ddp_fp32_bf16": (TrainPlan(dp=2, micro_batch_size=2, seq=16, grad_reduce_dtype="fp32"), torch.bfloat16),
        "fsdp_fp32_bf16": (TrainPlan(dp=2, zero=3, micro_batch_size=2, seq=16, grad_reduce_dtype="fp32",
                                     reshard_after_forward=False), torch.bfloat16)}


def real_rank(out_dir: str) -> None:
    from syntorch.parallel import plans
    from syntorch.parallel.launch import init_distributed
    from syntorch.parallel.mesh import init_groups
    from syntorch.trace.tracer import Tracer

    rank, world = init_distributed("cpu")
    results = {}
    for name, (plan, dtype) in REAL.items():
        groups = init_groups(plan.mesh, CONFIG.tied_head)
        torch.manual_seed(0)
        run = plans.apply_plans(CONFIG, plan, groups, "cpu", dtype)
        x, y = global_batch(CONFIG, plan)
        n, b = plan.microbatches * plan.micro_batch_size, plan.micro_batch_size
        batches = [(x[i:i + b], y[i:i + b]) for i in range(rank * n, (rank + 1) * n, b)]
        with Tracer(run.model, rank=rank, world_size=world, default_phase=None) as tracer:
            loss = plans.train_step(run, batches, tracer.phase)
        result = {"loss": loss.item(), "collectives": [[d["collective"], d["bytes"], d["phase"]]
                                                       for _, d in tracer.graph.collectives()]}
        if dtype == torch.float32:
            result.update(errors(run, plan, rank))
        elif plan.zero == 3:
            result["grads"] = [unit.shard.grad.float().tolist() for unit in run.grad_sync.units]
        else:
            result["grads"] = {n: p.grad.float().tolist() for n, p in run.model.named_parameters()}
        results[name] = result
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)


def bf16_reference(plan) -> dict:
    """Each DP rank's bf16 gradients of its half of the batch, made in one process, averaged in FP32 and cast
    to bf16: what an FP32 reduction of the ranks' gradients gives."""
    x, y = global_batch(CONFIG, plan)
    torch.manual_seed(0)
    model = build_model(CONFIG, "cpu", torch.bfloat16).train()
    total = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each of the 2 ranks (launch.py): bf16 CPU sums depend on the threads' split
    try:
        for half in (slice(0, 2), slice(2, 4)):
            model.zero_grad()
            F.cross_entropy(model(x[half]).flatten(0, 1).float(), y[half].flatten()).backward()
            for n, p in model.named_parameters():
                total[n] = total.get(n, 0) + p.grad.float() / 2
    finally:
        torch.set_num_threads(threads)
    return {n: g.bfloat16().float() for n, g in total.items()}


def fsdp_shards(reference: dict, units_params: list[list[str]], rank: int) -> list[torch.Tensor]:
    """This rank's half of each FSDP unit's flat gradient (padded to even), as fsdp.py lays it out."""
    out = []
    for names in units_params:
        flat = torch.cat([reference[n].flatten() for n in names])
        flat = torch.cat([flat, flat.new_zeros(flat.numel() % 2)])
        out.append(flat.chunk(2)[rank])
    return out


def unit_names() -> list[list[str]]:
    """FullyShard's units in order: the ends (every parameter outside the layers), then each layer's."""
    names = [n for n, _ in build_model(CONFIG, "meta").named_parameters()]
    layers = [[n for n in names if n.startswith(f"layers.{i}.")] for i in range(CONFIG.n_layer)]
    return [[n for n in names if not n.startswith("layers.")], *layers]


def test_real_steps_equal_one_process(tmp_path):
    from syntorch.parallel.launch import spawn

    spawn(real_rank, 2, (str(tmp_path),))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name, (plan, dtype) in REAL.items():
        ranks = [r[name] for r in results]
        backward = [c for r in ranks for c in r["collectives"] if c[2] == "backward"]
        if plan.zero == 3 and not plan.reshard_after_forward:
            assert not [c for c in backward if c[0] == "all_gather"], name
        if dtype == torch.float32:
            assert sum(r["loss"] for r in ranks) / 2 == pytest.approx(ranks[0]["ref_loss"], abs=1e-5)
            for r in ranks:
                assert r["grad_err"] < 1e-5 and r["param_err"] < 1e-5, f"{name}: {r}"
            continue
        reduced = [c for c in backward if c[0] in ("all_reduce", "reduce_scatter")]
        n_params = sum(p.numel() for p in build_model(CONFIG, "meta").parameters())
        # FP32 on the wire: 4 bytes per gradient element (all-reduce: whole; reduce-scatter: whole input)
        assert 4 * n_params <= sum(c[1] for c in reduced) // 2 < 4 * (n_params + 2 * len(unit_names()))  # + padding
        reference = bf16_reference(plan)
        for rank, r in enumerate(ranks):
            if plan.zero == 3:
                want = fsdp_shards(reference, unit_names(), rank)
                for got, ref in zip(r["grads"], want):
                    torch.testing.assert_close(torch.tensor(got), ref, rtol=0, atol=0, msg=name)
            else:
                for key, got in r["grads"].items():
                    torch.testing.assert_close(torch.tensor(got), reference[key], rtol=0, atol=0, msg=lambda m: f"{name} {key} {m}")
