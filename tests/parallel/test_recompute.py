"""Activation recomputation (--recompute none|selective|full): what backward runs again, its FLOPs against
Korthikanti et al. 2022, and real CPU gradients equal to those without recomputation."""
import collections
import re

import pytest
import torch
from conftest import tiny_config

from syntorch.cli import main
from syntorch.errors import UserError
from syntorch.parallel import plans
from syntorch.parallel.distributed import symbolic_world
from syntorch.parallel.mesh import init_groups
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.tracer import SDPA, Tracer
from syntorch.trace.training import trace_stage

CONFIG = tiny_config("gpt2", n_layer=3)  # d_model 64 = 4 heads x 16, d_ff = 4 d_model (Korthikanti's layer)
B, S = 2, 32


def backward_ops(recompute: str, tp: int = 1):
    graph = trace_stage(CONFIG, TrainPlan(tp=tp, seq=S, micro_batch_size=B, recompute=recompute), 0)
    return graph, [d for d in graph.node_attrs.values() if d["kind"] == "op" and d["phase"] == "backward"]


def forward_ops(graph):
    return [d for d in graph.node_attrs.values() if d["kind"] == "op" and d["phase"] == "forward"]


def flops(ops) -> int:
    """With attention over every score, as Korthikanti et al. count it (`flops` keeps the causal pairs only)."""
    return sum(d.get("dense_flops", d["flops"]) for d in ops)


def layer_forward_flops(b, s, h) -> int:
    """Korthikanti et al. 2022, section 6 / appendix A: one layer's forward GEMMs, 24bsh^2 + 4bs^2h
    (QKV 6bsh^2, QK^T 2bs^2h, attention over V 2bs^2h, projection 2bsh^2, MLP 16bsh^2)."""
    return 24 * b * s * h * h + 4 * b * s * s * h


def test_selective_adds_the_attention_core_of_every_layer_to_backward():
    _, base = backward_ops("none")
    _, selective = backward_ops("selective")
    added = collections.Counter(d["name"] for d in selective) - collections.Counter(d["name"] for d in base)
    # exactly one more fused attention forward per layer, plus the copies autograd's checkpoint makes of
    # its inputs (detach) and of the incoming gradient (clone): no GEMM, no layer norm
    assert added[SDPA] == CONFIG.n_layer and set(added) <= {SDPA, "aten.detach", "aten.clone"}
    # the recomputed attention core: QK^T and attention over V, 4bs^2h per layer
    assert flops(selective) - flops(base) == CONFIG.n_layer * 4 * B * S * S * CONFIG.d_model
    assert {d["module"] for d in selective if d["name"] == SDPA} == {f"layers.{i}.attn" for i in range(CONFIG.n_layer)}


@pytest.mark.parametrize("tp", [1, 2])
def test_full_adds_each_layer_forward_to_backward(tp):
    graph, base = backward_ops("none", tp)
    full_graph, full = backward_ops("full", tp)
    layer_fwd = [d for d in forward_ops(graph) if d["module"].startswith("layers.")]
    assert flops(full) - flops(base) == flops(layer_fwd) == CONFIG.n_layer * layer_forward_flops(B, S, CONFIG.d_model) // tp
    # every op a layer ran forward runs again in backward, with its collectives under TP
    added = collections.Counter(d["name"] for d in full) - collections.Counter(d["name"] for d in base)
    ran = collections.Counter(d["name"] for d in layer_fwd if not d["is_view"])
    assert all(added[name] >= count for name, count in ran.items())
    backward_comm = lambda g: sum(d["phase"] == "backward" for _, d in g.collectives())
    assert backward_comm(full_graph) - backward_comm(graph) == 2 * CONFIG.n_layer * (tp > 1)  # forward all-reduces again
    assert flops(forward_ops(full_graph)) == flops(forward_ops(graph))  # the forward itself is unchanged


def real_step(config, recompute: str, traced: bool):
    plan = TrainPlan(seq=S, micro_batch_size=B, recompute=recompute)
    with symbolic_world(0, 1):
        groups = init_groups(plan.mesh, config.tied_head)
        torch.manual_seed(0)
        run = plans.apply_plans(config, plan, groups, "cpu")
        tokens = torch.randint(0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
        if traced:
            with Tracer(run.model, default_phase=None) as tracer:
                plans.train_step(run, [(tokens, tokens)], tracer.phase)
        else:
            plans.train_step(run, [(tokens, tokens)])
    return {n: p.detach().clone() for n, p in run.model.named_parameters()}


@pytest.mark.parametrize("base", ["gpt2", "gptj-6b"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_real_cpu_step_updates_the_same_parameters(base, recompute):
    config = tiny_config(base)
    expected = real_step(config, "none", traced=False)
    for traced in (False, True):
        got = real_step(config, recompute, traced)
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, msg=f"{name} with --recompute {recompute}")


@pytest.mark.parametrize("fields, message", [
    (dict(recompute="some"), "--recompute must be one of none, selective, full, got 'some'"),
    (dict(recompute="full", mode="infer"), "--recompute full recomputes activations in backward"),
])
def test_bad_recompute_is_one_line(fields, message):
    with pytest.raises(UserError, match=re.escape(message)):
        TrainPlan(**fields)


def test_trace_command_takes_recompute(tmp_path, capsys):
    from syntorch.config import save_model_config

    path = tmp_path / "tiny.json"
    save_model_config(CONFIG, path)
    args = ["trace", "--model_config", str(path), "--seq", "16", "--no_progress"]
    assert main([*args, "--recompute", "selective", "--out", str(tmp_path / "out")]) == 0
    assert main([*args, "--mode", "infer", "--recompute", "full", "--out", str(tmp_path / "bad")]) == 2
    assert "drop --recompute" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
