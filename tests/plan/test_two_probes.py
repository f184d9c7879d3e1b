"""Cost probes of two micro-batches (trace/training.py's COST_MICROBATCHES): a middle backward is derived from
the last one without the nodes of its gradient sync (layer_probe.middle_steps). Against probes of three
micro-batches, whose middle backward is traced: the derived middle's StepCost is the traced one's, and
predictions (step, bubble, exposed communication, busy time, FLOPs, MFU) are equal to float precision."""
import pytest
import torch
from conftest import tiny_config

from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.plan import evaluate
from syntorch.plan.evaluate import ProbeCache, predict_plan
from syntorch.simulate.prediction import predict_training
from syntorch.simulate.steps import StepCost, stage_costs, step_costs
from syntorch.trace.cost import fill_durations
from syntorch.trace.layer_probe import MIDDLE, layer_probe, whole_probe
from syntorch.trace.training import traced_stage_for

HW = load_hw_config("h100-sxm")
GPT = tiny_config("gpt2", n_layer=4)  # its head tied to the embedding
LLAMA = tiny_config("llama-3-8b", n_layer=4, n_kv_head=2)
MOE = tiny_config("deepseek-v3", n_layer=3, n_head=4, d_head=24, rotary_dim=8, v_head_dim=12, kv_lora_rank=16,
                  q_lora_rank=24, n_experts=4, d_ff_expert=32, d_ff=64, moe_top_k=2, first_k_dense=1,
                  moe_n_group=2, moe_topk_group=1, rope_original_positions=16)
# long enough runs of alike layers for kept-layer probes (layer_probe.reduced)
GPT_LONG = tiny_config("gpt2", n_layer=12)
LLAMA_LONG = tiny_config("llama-3-8b", n_layer=6, n_kv_head=2)
BUCKETS = dict(bucket_mb=0.05)  # several buckets, launched in the middle of backward

WHOLE = {  # (config, plan, profile)
    "ddp_buckets": (LLAMA, TrainPlan(dp=2, microbatches=4, seq=16, **BUCKETS), "fused"),
    "ddp_one_bucket_eager": (LLAMA, TrainPlan(dp=2, microbatches=4, seq=16), "eager"),
    "ddp_no_overlap": (LLAMA, TrainPlan(dp=2, microbatches=4, seq=16, overlap_grad_reduce=False, **BUCKETS), "fused"),
    "zero1": (LLAMA, TrainPlan(dp=2, zero=1, microbatches=4, seq=16, **BUCKETS), "fused"),
    "zero2_fp32_reduce": (LLAMA, TrainPlan(dp=2, zero=2, microbatches=5, seq=16, grad_reduce_dtype="fp32",
                                           **BUCKETS), "fused"),
    "zero1_param_gather": (LLAMA, TrainPlan(dp=2, zero=1, microbatches=4, seq=16, overlap_param_gather=True,
                                            **BUCKETS), "fused"),
    "fsdp_tied_pp": (GPT, TrainPlan(dp=2, pp=2, zero=3, microbatches=4, seq=16), "fused"),
    "ddp_tied_pp": (GPT, TrainPlan(dp=2, pp=2, microbatches=4, seq=16, **BUCKETS), "eager"),
    "interleaved_tp_sp": (GPT, TrainPlan(dp=2, tp=2, pp=2, virtual_stages=2, sp=True, microbatches=4, seq=16,
                                         **BUCKETS), "fused"),
    "cp_recompute_full": (LLAMA, TrainPlan(dp=2, cp=2, microbatches=4, seq=16, recompute="full", **BUCKETS), "fused"),
    "selective_eager": (LLAMA, TrainPlan(dp=2, microbatches=4, seq=16, recompute="selective", **BUCKETS), "eager"),
    "moe_ep": (MOE, TrainPlan(dp=2, ep=2, microbatches=4, seq=16, **BUCKETS), "fused"),
}
KEPT = {
    "kept_zero1_sp": (GPT_LONG, TrainPlan(dp=2, tp=2, sp=True, zero=1, microbatches=4, seq=16, **BUCKETS), "fused"),
    "kept_ddp_interleaved": (tiny_config("gpt2", n_layer=20), TrainPlan(dp=2, pp=2, virtual_stages=2,
                                                                       microbatches=4, seq=16, **BUCKETS), "fused"),
    "kept_fsdp_recompute": (LLAMA_LONG, TrainPlan(dp=2, zero=3, microbatches=4, seq=16, recompute="full"), "fused"),
    "kept_ddp_no_overlap_eager": (GPT_LONG, TrainPlan(dp=2, microbatches=4, seq=16, overlap_grad_reduce=False,
                                                      **BUCKETS), "eager"),
}
FIGURES = ("step_s", "bubble_fraction", "exposed_comm_s", "busy_s", "model_flops", "hardware_flops", "mfu")


def probes(config, plan, microbatches: int, profile: str, probe) -> dict:
    out = {s: probe(config, plan, s, torch.float32, microbatches) for s in sorted(set(traced_stage_for(config, plan)))}
    for graph in (graph for p in out.values() for graph in p.graphs):
        fill_durations(graph, HW, profile, "flash")
    return out


@pytest.mark.parametrize("name", [*WHOLE, *KEPT])
def test_a_derived_middle_backward_costs_what_a_traced_one_does(name, one_thread):
    config, plan, profile = {**WHOLE, **KEPT}[name]
    probe = whole_probe if name in WHOLE else layer_probe
    two, three = (probes(config, plan, m, profile, probe) for m in (2, 3))
    assert all(bool(p.runs) == (name in KEPT) for p in two.values())  # no kept case passes by probing whole
    for stage in two:
        derived, traced = stage_costs(two[stage], plan.mesh), stage_costs(three[stage], plan.mesh)
        middles = [key for key in traced if key[:2] == ("B", 1)]
        assert middles and all(derived["B", MIDDLE, key[2]] == traced[key] for key in middles)
    source = traced_stage_for(config, plan)
    derived, traced = (predict_training(p, source, plan, HW, profile).summary for p in (two, three))
    for key in FIGURES:
        assert derived[key] == pytest.approx(traced[key], rel=1e-9), key


def test_a_middle_backward_is_the_last_one_less_its_sync_where_the_sync_is_traced():
    """DDP's middle has fewer nodes than its last backward (bucket launches, the end of backward); FSDP
    reduce-scatters in every backward: its last runs nothing more here (no tied weight), no graph of its own."""
    ddp = whole_probe(LLAMA, WHOLE["ddp_buckets"][1], 0, torch.float32, 2)
    (middle, blocks), = ddp.middles.values()
    (start, end), = blocks.values()
    last_start, last_end = ddp[1]["B", 1, 0]
    assert sum(d["kind"] == "collective" for n, d in middle.node_attrs.items() if n >= start) == 0
    assert end - start < last_end - last_start
    fsdp = whole_probe(LLAMA, TrainPlan(dp=2, zero=3, microbatches=4, seq=16), 0, torch.float32, 2)
    assert fsdp.middles == {0: None}


def test_a_scheduled_middle_backward_costs_the_derived_middle():
    """Two probed micro-batches for a step of 5: forwards after the first copy the second; the first and
    the last backward are the probed ones, those between the derived middle; with 2 the probed steps."""
    costs = {(kind, m, 0): StepCost(100 * (kind == "B") + 10 * m, 0.0) for kind in "FB" for m in range(2)}
    costs["B", MIDDLE, 0] = StepCost(150.0, 0.0)
    steps = [("F", 0, 0), ("F", 3, 0), ("B", 0, 0), ("B", 1, 0), ("B", 3, 0), ("B", 4, 0)]
    assert [c.us for c in step_costs(costs, steps, 5)] == [0, 10, 100, 150, 150, 110]
    assert [c.us for c in step_costs(costs, [("B", 0, 0), ("B", 1, 0)], 2)] == [100, 110]


def test_layouts_sharing_moved_probes_predict_as_with_three_micro_batches(monkeypatch, one_thread):
    """plan/evaluate.py's ProbeCache: a kept-layer probe moved to another pipeline depth (retarget.py) moves
    its derived middles too; predictions equal those of probes of three micro-batches."""
    plans = [TrainPlan(pp=pp, dp=8 // pp, zero=1, tp=2, sp=True, microbatches=6, seq=16, **BUCKETS) for pp in (2, 4)]
    config = tiny_config("gpt2", n_layer=20)

    def predicted():
        cache = ProbeCache()
        return [predict_plan(config, plan, HW, cache, torch.float32).summary for plan in plans]

    two = predicted()
    monkeypatch.setattr(evaluate, "COST_MICROBATCHES", 3)
    for derived, traced in zip(two, predicted()):
        for key in FIGURES:
            assert derived[key] == pytest.approx(traced[key], rel=1e-9), key
