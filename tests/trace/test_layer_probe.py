"""Predictions from probes of fewer layers (trace/layer_probe.py) against probing every layer: the same step
time, MFU, bubble and exposed communication, on plans whose stages leave layers out (checked, so no case
passes by probing whole) and on those that must be probed whole."""
import dataclasses

import pytest
import torch

from conftest import tiny_config
from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.simulate.prediction import predict_training
from syntorch.trace.cost import fill_durations
from syntorch.trace.layer_probe import KeptLayers, expand_step, reduced
from syntorch.trace.step_schedule import schedule_stage
from syntorch.trace.training import probe_stage, shift_stage, trace_stage, traced_stage_for
from syntorch.workload import trace_workload

HW = load_hw_config("a100-80gb")
GPT = tiny_config("gpt2", n_layer=20, d_model=128, n_head=4, d_head=32, d_ff=512, vocab_size=128)
LLAMA = tiny_config("llama-3-8b", n_layer=16, d_model=128, n_head=4, n_kv_head=2, d_head=32, d_ff=256, vocab_size=128)
# DeepSeek-style: 3 dense layers, then MoE ones (two runs of alike layers on the first stage)
MOE = tiny_config("deepseek-v3", n_layer=16, n_head=4, d_head=24, rotary_dim=8, v_head_dim=12, kv_lora_rank=16,
                  q_lora_rank=24, n_experts=8, d_ff_expert=32, d_ff=64, moe_top_k=3, first_k_dense=3,
                  moe_n_group=4, moe_topk_group=2, rope_original_positions=16)

LEFT_OUT = {  # plans whose probes leave layers out
    "tp": (GPT, TrainPlan(tp=2, microbatches=4, seq=32)),
    "tp_pp_recompute": (LLAMA, TrainPlan(tp=2, pp=2, microbatches=4, seq=32, recompute="full")),
    "interleaved": (GPT, TrainPlan(pp=2, virtual_stages=2, microbatches=4, seq=32)),
    "uneven": (GPT, TrainPlan(pp=3, microbatches=6, seq=32, first_stage_layers=7, last_stage_layers=5)),
    "fsdp": (GPT, TrainPlan(dp=2, pp=2, zero=3, microbatches=4, seq=32)),
    "fsdp_unsharded": (LLAMA, TrainPlan(dp=2, zero=3, reshard_after_forward=False, microbatches=3, seq=32)),
    "fsdp_cp": (LLAMA, TrainPlan(dp=2, cp=2, zero=3, microbatches=2, seq=32)),
    "moe_dense_first": (MOE, TrainPlan(pp=2, microbatches=4, seq=32)),
}
# the end of the last backward synchronises every layer's gradients: the whole stage's end in place of the
# probe's; with overlap, buckets of 0.1 MiB cut at every layer's large weights (as 25 MiB do in large models)
for overlap in (True, False):
    o = "" if overlap else "_no_overlap"
    LEFT_OUT.update({
        f"ddp{o}": (GPT, TrainPlan(dp=2, microbatches=3, seq=32, bucket_mb=0.1, overlap_grad_reduce=overlap)),
        f"zero1{o}": (GPT, TrainPlan(dp=2, zero=1, microbatches=3, seq=32, bucket_mb=0.1, overlap_grad_reduce=overlap)),
        f"zero2_pp{o}": (LLAMA, TrainPlan(dp=2, pp=2, zero=2, microbatches=4, seq=32, bucket_mb=0.1,
                                          overlap_grad_reduce=overlap)),
        f"sp{o}": (GPT, TrainPlan(tp=2, sp=True, microbatches=3, seq=32, overlap_grad_reduce=overlap)),
        f"ddp_sp{o}": (LLAMA, TrainPlan(dp=2, tp=2, sp=True, microbatches=3, seq=32, bucket_mb=0.1,
                                        grad_reduce_dtype="fp32", overlap_grad_reduce=overlap)),
        f"ddp_sp_interleaved{o}": (GPT, TrainPlan(dp=2, tp=2, pp=2, virtual_stages=2, sp=True, microbatches=4, seq=32,
                                                  bucket_mb=0.1, overlap_grad_reduce=overlap)),
        f"zero1_sp_interleaved{o}": (GPT, TrainPlan(dp=2, tp=2, pp=2, virtual_stages=2, sp=True, zero=1,
                                                    microbatches=4, seq=32, bucket_mb=0.1,
                                                    overlap_grad_reduce=overlap)),
    })
WHOLE = {  # the first forward gathers every ZeRO bucket; buckets spanning layers (one of 25 MiB holds all)
    "zero1_param_gather": (GPT, TrainPlan(dp=2, zero=1, microbatches=3, seq=32, bucket_mb=0.1,
                                          overlap_param_gather=True)),
    "ddp_one_bucket": (GPT, TrainPlan(dp=2, microbatches=3, seq=32)),
}


def summaries(config, plan):
    out = []
    for layer_probes in (True, False):
        workload = trace_workload(config, plan, torch.float32, HW, schedule=False, layer_probes=layer_probes)
        out.append((workload, predict_training(workload.probes, workload.source, plan, HW).summary))
    return out


def same_prediction(fewer: dict, every: dict) -> None:
    for key in ("step_s", "busy_s", "exposed_comm_s", "mfu", "hfu", "model_flops"):
        assert fewer[key] == pytest.approx(every[key], rel=1e-3, abs=1e-12), key
    assert fewer["bubble_fraction"] == pytest.approx(every["bubble_fraction"], abs=1e-3)


@pytest.mark.parametrize("name", LEFT_OUT)
def test_a_probe_of_fewer_layers_predicts_what_probing_every_layer_does(name):
    config, plan = LEFT_OUT[name]
    (fewer, mine), (_, theirs) = summaries(config, plan)
    assert any(probe.runs for probe in fewer.probes.values())  # layers were left out
    same_prediction(mine, theirs)


@pytest.mark.parametrize("name", WHOLE)
def test_plans_whose_steps_fewer_layers_cannot_stand_for_are_probed_whole(name):
    config, plan = WHOLE[name]
    (fewer, mine), (_, theirs) = summaries(config, plan)
    assert not any(probe.runs for probe in fewer.probes.values())
    same_prediction(mine, theirs)


def test_runs_of_alike_layers_keep_four_each():
    plan = TrainPlan(pp=2, microbatches=4, seq=32)
    (kept,), runs = reduced(MOE, plan, 0)
    assert kept == (0, 1, 2, 3, 4, 5, 6)  # the three dense layers whole, four of the five MoE ones
    assert runs == [(0, (3, 4, 5, 6), 1)]


def test_an_expanded_step_has_the_whole_stages_ops():
    """A forward expanded from four layers runs the ops and FLOPs of a forward of all eight."""
    plan = TrainPlan(tp=2, microbatches=2, seq=32)
    config = tiny_config("gpt2", n_layer=8)
    (kept,), runs = reduced(config, plan, 0)
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.init}
    few, few_blocks = probe_stage(config, KeptLayers(**fields, kept=(0, (kept,))), 0, microbatches=2)
    every, blocks = probe_stage(config, plan, 0, microbatches=2)
    for key in (("F", 1, 0), ("B", 1, 0)):
        step = expand_step(few, *few_blocks[key], runs)
        start, end = blocks[key]
        whole = [every.node_attrs[n] for n in range(start, end)]
        assert len(step) == len(whole)
        assert [d["name"] for d in step.node_attrs.values() if d["kind"] != "tensor"] == \
            [d["name"] for d in whole if d["kind"] != "tensor"]
        assert sum(d.get("flops", 0) for d in step.node_attrs.values()) == sum(d.get("flops", 0) for d in whole)


def test_a_middle_stage_is_derived_only_from_one_with_layers_of_its_kinds():
    """DeepSeek over 8 stages: stage 1 holds the last dense layer and an MoE one, so it is traced itself;
    stage 3 (MoE only) derived from stage 2 by shifting equals tracing it."""
    plan = TrainPlan(pp=8, microbatches=8, seq=16)
    assert traced_stage_for(MOE, plan) == [0, 1, 2, 2, 2, 2, 2, 7]
    probe, blocks = probe_stage(MOE, plan, 2)
    derived = schedule_stage(shift_stage(probe, plan.mesh, 3, 2), blocks, plan)
    traced = trace_stage(MOE, plan, 3, replicate=False)
    assert dict(derived.nodes(data=True)) == dict(traced.nodes(data=True))
    assert list(derived.edges(data=True)) == list(traced.edges(data=True))


def test_a_derived_stage_costs_as_if_costed_after_shifting():
    """Workload.stages makes a stage's graph when asked: a derived one is its source's costed probe shifted,
    its collectives (which may now span other nodes) costed again; node for node as costing every node of
    the shifted probe, and for a traced one as its costed probe scheduled."""
    config, plan = tiny_config("gpt2", n_layer=8, vocab_size=200), TrainPlan(tp=4, pp=4, microbatches=4, seq=16)
    workload = trace_workload(config, plan, torch.float32, HW)
    assert workload.source == [0, 1, 1, 3]
    # stage 1 sends to the next node (8 GPUs each), stage 2 within its own: what costing again must see
    sends = [{d["duration_us"] for _, d in workload.stages[s].collectives() if d["collective"] == "send"
              and d["phase"] == "forward"} for s in (1, 2)]
    assert sends[0] != sends[1]
    for s, derived in enumerate(workload.stages):
        probe, blocks = probe_stage(config, plan, workload.source[s], torch.float32)
        probe = shift_stage(probe, plan.mesh, s, 2 * (s - workload.source[s]))
        fill_durations(probe, HW)
        want = schedule_stage(probe, blocks, plan)
        assert dict(derived.nodes(data=True)) == dict(want.nodes(data=True)), f"stage {s}"
        assert list(derived.edges(data=True)) == list(want.edges(data=True))


def test_a_stated_routing_load_makes_an_moe_layer_with_another_row_another_kind():
    rows = [(1 / 8,) * 8] * 13  # MOE's 13 MoE layers (3..15), each expert an eighth of the tokens
    plan = TrainPlan(pp=2, microbatches=4, seq=32, moe_load=tuple(rows))
    assert reduced(MOE, plan, 1)[1] == [(0, (8, 9, 10, 11), 4)]
    rows[10 - 3] = (0.3,) + (0.1,) * 7  # layer 10 routes more to expert 0
    plan = TrainPlan(pp=2, microbatches=4, seq=32, moe_load=tuple(rows))
    assert reduced(MOE, plan, 1)[1] == [(0, (11, 12, 13, 14), 1)]  # 8-9, 10, then 11-15
    assert traced_stage_for(MOE, TrainPlan(pp=8, microbatches=8, seq=32, moe_load=tuple(rows))) == \
        [0, 1, 2, 2, 2, 5, 2, 7]  # stage 5 (layers 10, 11) traced on its own



L32 = tiny_config("llama-3-8b", n_layer=32, d_model=128, n_head=4, n_kv_head=2, d_head=32, d_ff=256, vocab_size=128)
FSDP_FULL = {  # (model, plan, the runs stage 0's probe stands for)
    "fsdp_full": (LLAMA, TrainPlan(dp=2, tp=2, sp=True, zero=3, recompute="full", microbatches=3, seq=32),
                  [(0, (0, 1, 2, 3, 4), 11)]),
    "fsdp_full_interleaved": (L32, TrainPlan(dp=2, tp=2, pp=2, virtual_stages=2, zero=3, recompute="full",
                                             microbatches=4, seq=32),
                              [(0, (0, 1, 2, 3, 4, 5), 2), (1, (16, 17, 18, 19, 20, 21), 2)]),
}


@pytest.mark.parametrize("name", FSDP_FULL)
def test_fsdp_recomputing_every_layer_keeps_five_or_six_layers_a_run(name):
    """Under the fused profile the backward of the second-last layers fuses otherwise (of an interleaved chunk,
    the third-last too): with fewer kept layers such a period was the one repeated (the step failed to expand)."""
    config, plan, kept = FSDP_FULL[name]
    assert reduced(config, plan, 0)[1] == kept
    out = [trace_workload(config, plan, torch.bfloat16, HW, schedule=False, profile="fused", layer_probes=probes)
           for probes in (True, False)]
    assert any(probe.runs for probe in out[0].probes.values())
    mine, theirs = (predict_training(w.probes, w.source, plan, HW, "fused").summary for w in out)
    same_prediction(mine, theirs)
