"""Physical effects of the training timing added for issue 21's accuracy goals, each checked against a hand
count from its source."""
import pytest
import torch
from conftest import tiny_config

from syntorch.hardware import config_from_dict, load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.simulate.engine import simulate
from syntorch.simulate.graphs import MeshFrame, graph_program
from syntorch.trace.cost import fill_durations
from syntorch.trace.training import trace_stage
from syntorch.trace.attention import SDPA
from syntorch.trace.kernels import attention_us, gemm_us

A100 = load_hw_config("a100-80gb")


@pytest.mark.parametrize("name, kernels, passes", [(SDPA, 3, 4), (SDPA + "_backward", 5, 7)])
def test_megatrons_unfused_core_drops_out_its_probabilities_in_training(name, kernels, passes):
    """Megatron's CoreAttention runs attention dropout (--attention-dropout 0.1 by default) as a kernel of its
    own: forward, P read and the dropped P written with a one-byte mask; backward, the gradient and the mask
    read and the gradient written (Korthikanti et al. 2022, Table 2: as^2b mask bytes, 2as^2b output). Inference
    (FasterTransformer's context attention) runs none."""
    b, h, s, d = 4, 8, 2048, 128
    q = (b, h, s, d)
    scores = b * h * s * s
    io = 4 * b * h * s * d * 2
    dense = 4 * b * h * s * s * d * (1 if name == SDPA else 2.5)
    bw, peak = 2039e9 * A100.memory_efficiency, 312e12 * A100.gemm_efficiency
    base = kernels * A100.kernel_overhead_us + 1e6 * (dense / peak + (io + passes * scores * 2) / bw)
    dropout = A100.kernel_overhead_us + 1e6 * (2 * scores * 2 + scores) / bw
    infer = attention_us(name, dense // 2, io, q, q, "float16", A100, "fused", "unfused")
    train = attention_us(name, dense // 2, io, q, q, "float16", A100, "fused", "unfused", training=True)
    assert infer == pytest.approx(base)
    assert train == pytest.approx(base + dropout)
    # a flash kernel drops out inside itself; PyTorch's math path (eager) of a model without dropout runs none
    for attention, profile in (("flash", "fused"), ("unfused", "eager")):
        assert attention_us(name, dense // 2, io, q, q, "float16", A100, profile, attention, training=True) == \
            attention_us(name, dense // 2, io, q, q, "float16", A100, profile, attention)


def test_megatron_2021s_tp_backward_all_reduce_holds_the_compute():
    """--async_tp_allreduce false (Megatron-LM 2021): each TP collective of backward follows the compute before it
    and holds the compute after, so the backward is the plain sum of its kernels and collectives; true (2022 on)
    lets an input gradient's all-reduce overlap the weight gradient: shorter, and never shorter than its compute."""
    config = tiny_config("gpt2", n_layer=2, d_model=512, d_ff=2048, n_head=8, d_head=64)
    plan = TrainPlan(tp=2, seq=512, micro_batch_size=4)
    graph = trace_stage(config, plan, 0, dtype=torch.float16)
    fill_durations(graph, A100, "fused", "unfused")
    nodes = [n for n, d in graph.node_attrs.items() if d["kind"] != "tensor" and d["phase"] == "backward"]
    frame = MeshFrame(plan.mesh)
    ends = {sync: simulate([graph_program(graph, "b", frame, nodes=nodes, isolated=True, sync_tp_backward=sync)[0]]).end_us
            for sync in (False, True)}
    compute = sum(graph.node_attrs[n].get("duration_us") or 0 for n in nodes if graph.node_attrs[n]["kind"] == "op")
    comm = sum(graph.node_attrs[n]["duration_us"] for n in nodes if graph.node_attrs[n]["kind"] == "collective")
    assert comm > 0
    assert ends[True] == pytest.approx(compute + comm)
    assert compute <= ends[False] < ends[True]


def test_an_fp8_gemm_reaches_its_own_fraction_of_the_fp8_peak():
    """H100 SXM: the best FP8 matmul reaches 70.9% of 1,979 TFLOP/s, BF16 80.3% of 989 (Bekman's MAMF table). A
    full-wave 132-tile-multiple GEMM, math-bound: its time is its FLOPs at that fraction of the dtype's peak."""
    h100 = load_hw_config("h100-sxm")
    m, n, k = 128 * 132, 128 * 8, 16384
    flops = 2 * m * n * k
    for dtype, peak, fraction in (("float8_e4m3fn", 1978.9e12, 0.71), ("bfloat16", 989.4e12, 0.80)):
        assert gemm_us(1, m, n, k, 0, dtype, h100) == pytest.approx(h100.kernel_overhead_us + 1e6 * flops / (peak * fraction))
    # a JSON config without the field: FP8 GEMMs at gemm_efficiency, as before the field existed
    data = {k: v for k, v in h100.to_dict().items() if k != "fp8_gemm_efficiency"}
    plain = config_from_dict(data)
    assert plain.math_efficiency("gemm", "float8_e4m3fn") == plain.gemm_efficiency
