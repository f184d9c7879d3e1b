"""Qwen3, Qwen3-MoE and GPT-OSS under tensor (and sequence) and expert parallelism on real gloo ranks, against one process: logits,
greedy tokens and every parameter's gradient (the sinks split by heads, the q/k norms' partial gradients summed,
GPT-OSS's biased experts inside the MoE layer's one TP region); and their symbolic runs on meta."""
import copy

import pytest
import torch
import torch.distributed as dist

from syntorch.generate import Sampling, generate
from syntorch.models import build_model
from syntorch.parallel.expert import apply_ep, is_expert_param
from syntorch.parallel.launch import init_distributed, spawn
from syntorch.parallel.mesh import Mesh, init_groups
from syntorch.parallel.tensor import apply_tp, reduce_partial_grads, take_shard
from tests.conftest import in_turn, tiny_config

SMALL = dict(n_head=8, n_kv_head=2, d_head=8, d_ff=64, rotary_dim=0, vocab_size=100)
MOE = dict(n_experts=4, moe_top_k=2, d_ff_expert=32)
CONFIGS = {"qwen3": tiny_config("qwen3-8b", **SMALL),
           "qwen3-moe": tiny_config("qwen3-moe-30b-a3b", **SMALL, **MOE),
           "gpt-oss": tiny_config("gpt-oss-20b", **SMALL, **MOE, sliding_window=4, rope_original_positions=16)}
PROMPT = torch.tensor([[5, 17, 99, 3, 42, 8, 0, 64]])


def wide(name):
    """A model with wide random weights (norms, biases and sinks too): sharp attention and routing, so a wrong
    shard or a missed reduction shows."""
    torch.manual_seed(0)
    model = build_model(CONFIGS[name])
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def grads_after(model, idx):
    model.train()
    model(idx).square().mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def check_tp(name, groups, sequence_parallel=False):
    full = wide(name)
    model = copy.deepcopy(full)
    plan = apply_tp(model, groups, sequence_parallel)
    r, n = groups.tp_rank, groups.mesh.tp
    idx = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), full(idx), rtol=1e-4, atol=1e-4)
    want = generate(full, PROMPT, 6, Sampling(temperature=0)).tokens
    assert generate(model, PROMPT, 6, Sampling(temperature=0)).tokens == want, name
    expected, got = grads_after(full, idx), grads_after(model, idx)
    reduce_partial_grads(model, plan, groups)
    for param, grad in got.items():
        if expected[param] is None:  # an expert no token chose (sharp routing), on every rank alike
            assert grad is None, param
            continue
        module, _, kind = param.rpartition(".")
        shard = take_shard(plan.styles.get(module, "replicated"), kind, expected[param], r, n, plan.padded_vocab,
                           8, 2)
        torch.testing.assert_close(grad, shard, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {param}: {m}")
    if name == "gpt-oss":
        assert model.layers["0"].attn.sinks.weight.shape == (8 // n,)


def tp_main():
    init_distributed("cpu")
    groups = init_groups(Mesh(tp=dist.get_world_size()))
    for name in CONFIGS:
        check_tp(name, groups)
        check_tp(name, groups, sequence_parallel=True)  # an MoE layer gathers the sequence, reduce-scatters after



def check_ep(name):
    """Each rank routes its own batch row; the experts' owners get both rows' gradients by the all-to-alls, the
    rest is summed over the ranks here. Together they are one process's gradients over both rows."""
    rank = dist.get_rank()
    full = wide(name)
    model = copy.deepcopy(full)
    apply_ep(model, None)
    idx = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(idx[rank:rank + 1]), full(idx)[rank:rank + 1], rtol=1e-4, atol=1e-4)
    full.train()
    full(idx).square().mean(dim=(1, 2)).sum().backward()
    got = grads_after(model, idx[rank:rank + 1])
    first = model.layers["0"].mlp.first_expert
    for param, grad in got.items():
        if is_expert_param(param):  # local expert j is global expert first + j
            head, _, tail = param.partition(".experts.")
            local, _, rest = tail.partition(".")
            param = f"{head}.experts.{first + int(local)}.{rest}"
        else:
            dist.all_reduce(grad)
        want = dict(full.named_parameters())[param].grad
        if want is None:  # an expert no token chose (EP runs it on no rows: zeros)
            assert grad is None or not grad.any(), param
            continue
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {param}: {m}")


def ep_main():
    init_distributed("cpu")
    for name in ("qwen3-moe", "gpt-oss"):
        check_ep(name)


def test_tp2_and_ep2_match_one_process():
    """check_tp's and check_ep's checks on one launch of 2 ranks (each model built from seed 0 by `wide`)."""
    spawn(in_turn, 2, ((tp_main, ()), (ep_main, ())))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_symbolic_cli_runs_validate(name, tmp_path):
    """`infer --device meta --tp 2` and `trace` (--ep 2 --dp 2 for the MoE ones, --tp 2 --pp 2 for the dense one)
    write traces ASTRA-sim's rules accept."""
    from syntorch.cli import main
    from syntorch.config import save_model_config
    save_model_config(CONFIGS[name], tmp_path / "model.json")
    model = ["--model_config", str(tmp_path / "model.json")]
    assert main(["infer", *model, "--device", "meta", "--tp", "2", "--num_input_tokens", "6",
                 "--num_output_tokens", "3", "--chakra", "--out", str(tmp_path / "infer")]) == 0
    assert main(["validate", str(tmp_path / "infer" / "chakra")]) == 0
    layout = ["--ep", "2", "--dp", "2"] if CONFIGS[name].n_experts else ["--tp", "2", "--pp", "2"]
    assert main(["trace", *model, *layout, "--seq", "16", "--no_progress", "--out", str(tmp_path / "trace")]) == 0
    assert main(["validate", str(tmp_path / "trace")]) == 0
