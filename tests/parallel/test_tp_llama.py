"""Tensor parallelism for the Llama layout on real gloo ranks: 8 query heads over 2 K/V heads (TP 2 shards the
K/V heads, TP 4 replicates them), SwiGLU's fused [gate; up] column-parallel, Mixtral's experts each sharded;
logits, tokens and gradients equal TP 1."""
import copy

import pytest
import torch

from syntorch.errors import UserError
from syntorch.generate import Sampling, generate
from syntorch.models import build_model
from syntorch.parallel.launch import init_distributed, spawn
from syntorch.parallel.mesh import Mesh, init_groups
from syntorch.parallel.tensor import apply_tp, check_tp, reduce_partial_grads, take_shard
from tests.conftest import tiny_config

PROMPT = torch.tensor([[5, 17, 99, 3, 42, 8, 0, 64]])


def tiny_gqa(base, **kw):
    return tiny_config(base, n_head=8, n_kv_head=2, d_head=8, d_ff=64, rotary_dim=0, vocab_size=100, **kw)


CONFIGS = {"llama": tiny_gqa("llama-3-8b", rope_scaling="llama3", rope_original_positions=4),
           "qwen2": tiny_gqa("qwen2-7b", sliding_window=5),
           "mixtral": tiny_gqa("mixtral-8x7b", n_experts=4, d_ff_expert=32, n_shared_experts=1)}


def close(what, got, want, tol=1e-4):
    err = (got - want).abs().max().item()
    assert err <= tol, f"{what}: max abs error {err:.2e} > {tol}"


def check(name, groups):
    torch.manual_seed(0)
    full = build_model(CONFIGS[name])
    with torch.no_grad():
        for p in full.parameters():  # wide weights: sharp routing and attention, so a wrong shard shows
            p.normal_(0, 0.3)
    model = copy.deepcopy(full)
    plan = apply_tp(model, groups)
    r, n = groups.tp_rank, groups.mesh.tp
    # a sharded layout: our query heads and (shared or replicated) K/V heads
    q_rows, kv_rows = 8 // n * 8, max(1, 2 // n) * 8
    assert model.layers["0"].attn.qkv.weight.shape[0] == q_rows + 2 * kv_rows
    idx = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        close(name, model(idx), full(idx))
    for beams in (1, 2) if n == 2 else (1,):  # TP 4 (four processes on a small machine): greedy only
        want = generate(full, PROMPT, 5, Sampling(temperature=0), beam_width=beams).tokens
        assert generate(model, PROMPT, 5, Sampling(temperature=0), beam_width=beams).tokens == want, name
    full.train(), model.train()
    full(idx).square().mean().backward()
    model(idx).square().mean().backward()
    reduce_partial_grads(model, plan, groups)
    fc1 = "mlp.experts.1.fc1" if name == "mixtral" else "mlp.fc1"
    gate, up = full.get_submodule(f"layers.1.{fc1}").weight.grad.chunk(2)
    close(f"{name} fc1 grad", model.get_submodule(f"layers.1.{fc1}").weight.grad,
          torch.cat([gate.chunk(n)[r], up.chunk(n)[r]]), 1e-5)
    if name == "mixtral":  # each rank's router sees partial expert outputs: summed over TP
        assert "layers.0.mlp.router.weight" in plan.partial_grads
        close("router grad", model.layers["0"].mlp.router.weight.grad, full.layers["0"].mlp.router.weight.grad, 1e-5)


def rank_main():
    rank, world = init_distributed("cpu")
    groups = init_groups(Mesh(tp=world))
    for name in CONFIGS:
        check(name, groups)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_tp1_on_gqa_swiglu_and_moe(tp):
    spawn(rank_main, tp, ())


def test_qkv_shards_share_or_replicate_kv_heads():
    full = torch.arange(12 * 4).view(12, 4)  # d_head 1: rows 0-7 the 8 query heads, 8-9 k heads, 10-11 v heads

    def rows(t):
        return t[:, 0].div(4, rounding_mode="floor").tolist()

    assert rows(take_shard("colwise_qkv", "weight", full, 1, 2, 0, 1, kv_heads=2)) == [4, 5, 6, 7, 9, 11]
    # TP 4 over 2 K/V heads: ranks 0, 1 hold K/V head 0, ranks 2, 3 head 1
    assert [rows(take_shard("colwise_qkv", "weight", full, r, 4, 0, 1, kv_heads=2)) for r in range(4)] == [
        [0, 1, 8, 10], [2, 3, 8, 10], [4, 5, 9, 11], [6, 7, 9, 11]]
    gated = torch.arange(8)
    assert take_shard("colwise_gated", "bias", gated, 1, 2, 0, 1).tolist() == [2, 3, 6, 7]


def test_tp_errors_are_one_line():
    with pytest.raises(UserError, match=r"^--tp 4 does not divide .*'s attention heads \(6\); choose --tp from 1, 2, 6$"):
        check_tp(tiny_config("llama-3-8b", n_head=6, n_kv_head=2, d_ff=60, d_head=8), 4)
    with pytest.raises(UserError, match=r"^--tp 4 neither divides nor is a multiple of .*'s 6 K/V heads"):
        check_tp(tiny_config("llama-3-8b", n_head=12, n_kv_head=6, d_head=8), 4)
    with pytest.raises(UserError, match=r"FFN size \(30\)"):
        check_tp(tiny_config("mixtral-8x7b", n_head=8, n_kv_head=2, d_head=8, d_ff_expert=30), 4)


def test_moe_layer_is_one_tp_region():
    """Megatron's count: one all-reduce after attention and one after the whole MoE layer (not one per expert),
    and in backward one for each layer's input gradient."""
    from collections import Counter
    from syntorch.trace.generation import trace_tp_rank
    graph, _ = trace_tp_rank(CONFIGS["mixtral"], PROMPT, 2, 2, 0, False)
    per_module = Counter((d["phase"], d["module"]) for _, d in graph.collectives() if d["module"].startswith("layers.0"))
    assert per_module == {("prefill", "layers.0.attn.proj"): 1, ("prefill", "layers.0.mlp"): 1,
                          ("decode[0]", "layers.0.attn.proj"): 1, ("decode[0]", "layers.0.mlp"): 1}


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_symbolic_cli_runs_validate(name, tmp_path):
    """`infer --device meta --tp 4` and `trace --tp 2 --pp 2` on the Llama layout write traces ASTRA-sim's
    rules accept (syntorch validate)."""
    from syntorch.cli import main
    from syntorch.config import save_model_config
    save_model_config(CONFIGS[name], tmp_path / "model.json")
    model = ["--model_config", str(tmp_path / "model.json")]
    assert main(["infer", *model, "--device", "meta", "--tp", "4", "--num_input_tokens", "6",
                 "--num_output_tokens", "3", "--chakra", "--out", str(tmp_path / "infer")]) == 0
    assert main(["validate", str(tmp_path / "infer" / "chakra")]) == 0
    assert main(["trace", *model, "--tp", "2", "--pp", "2", "--seq", "16", "--no_progress",
                 "--out", str(tmp_path / "trace")]) == 0
    assert main(["validate", str(tmp_path / "trace")]) == 0
