"""Tensor parallelism: numerics equal TP=1 on real gloo ranks, Megatron's collective pattern in real and
symbolic traces, symmetric rank derivation, and faults (one line, or the failing rank named)."""
import copy
import json
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from conftest import tiny_config
from syntorch.errors import UserError
from syntorch.generate import Sampling, generate
from syntorch.models import build_model
from syntorch.parallel.launch import RankFailed, init_distributed, spawn
from syntorch.parallel.mesh import Mesh, init_groups
from syntorch.trace.generation import trace_tp_rank, trace_tp_symbolic
from syntorch.inference import RunOutputs, tp_inference_rank
from syntorch.parallel.tensor import apply_tp, check_tp, padded_vocab, reduce_partial_grads, take_shard
from syntorch.trace.generation import trace_generation

BASES = ("gpt2", "gptj-6b", "bert-base-uncased")
VOCAB = 100  # not a multiple of 128 * tp: the padded rows must never show
PROMPT = torch.tensor([[5, 17, 99, 3, 42, 8, 0, 64]])  # [1, 8]
NEW_TOKENS = 4
SAMPLING = Sampling(temperature=0.9, top_k=30, top_p=0.95, seed=11)


def tiny(base):
    return tiny_config(base, vocab_size=VOCAB)


def assert_close(name, got, want, tol=1e-4):
    err = (got - want).abs().max().item()
    if err > tol:
        raise AssertionError(f"{name}: max abs error {err:.2e} > {tol}")


def check_same_on_all_ranks(name, tokens, group):
    mine = torch.tensor(tokens)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    if any(not torch.equal(mine, other) for other in everyone):
        raise AssertionError(f"{name}: ranks chose different tokens")


def check_model(base, sequence_parallel, groups):
    """TP logits and tokens against the same model unsharded, computed on this rank."""
    torch.manual_seed(0)
    full = build_model(tiny(base))
    model = copy.deepcopy(full)
    apply_tp(model, groups, sequence_parallel)
    idx = torch.randint(0, VOCAB, (2, 8))
    what = f"{base} sp={sequence_parallel}"
    if base.startswith("bert"):
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, 6:] = 0
        assert_close(what, model(idx, attention_mask=mask), full(idx, attention_mask=mask))
        return
    with torch.no_grad():
        assert_close(what, model(idx), full(idx))
    for sampling in (Sampling(temperature=0), SAMPLING):
        want = generate(full, PROMPT, NEW_TOKENS, sampling).tokens
        got = generate(model, PROMPT, NEW_TOKENS, sampling).tokens
        assert got == want, f"{what} {sampling}: {got} != {want}"
        check_same_on_all_ranks(what, got, groups.tp)


def check_gradients(groups):
    """Backward through f/g: each shard's gradient is its slice of the unsharded gradient."""
    torch.manual_seed(0)
    full = build_model(tiny("gpt2")).train()
    model = copy.deepcopy(full)
    plan = apply_tp(model, groups, sequence_parallel=True)
    idx = torch.randint(0, VOCAB, (2, 8))
    full(idx).square().mean().backward()
    model(idx).square().mean().backward()
    reduce_partial_grads(model, plan, groups)
    assert {"layers.0.mlp.fc2.bias", "layers.1.ln2.weight", "ln_f.bias"} <= set(plan.partial_grads)
    assert not {"pos_emb.weight", "tok_emb.weight", "layers.0.attn.qkv.bias"} & set(plan.partial_grads)
    assert_close("ln1 weight grad", model.layers["0"].ln1.weight.grad, full.layers["0"].ln1.weight.grad, 1e-6)
    assert_close("ln_f bias grad", model.ln_f.bias.grad, full.ln_f.bias.grad, 1e-6)
    assert_close("pos_emb grad", model.pos_emb.weight.grad, full.pos_emb.weight.grad, 1e-6)
    r, n = groups.tp_rank, groups.mesh.tp
    full_fc2, tp_fc2 = full.layers["0"].mlp.fc2, model.layers["0"].mlp.fc2
    assert_close("fc2 weight grad", tp_fc2.weight.grad, full_fc2.weight.grad.chunk(n, 1)[r], 1e-6)
    assert_close("fc2 bias grad", tp_fc2.bias.grad, full_fc2.bias.grad, 1e-6)
    assert_close("qkv weight grad", model.layers["1"].attn.qkv.weight.grad,
                 full.layers["1"].attn.qkv.weight.grad.view(3, n, -1, 64)[:, r].reshape(-1, 64), 1e-6)


def collective_signature(graph):
    return [(d["phase"], d["collective"], d["module"], d["reduce_op"], d["bytes"], d["group"], d["order"])
            for _, d in graph.collectives()]


def numerics_rank(out_dir):
    """Every check at TP 2; at TP 4 (slower to spawn) the numerics only, sequence parallel for GPT-J."""
    rank, world = init_distributed("cpu")
    groups = init_groups(Mesh(tp=world))
    for base in BASES:
        for sp in (False, True) if world == 2 or base == "gptj-6b" else (False,):
            check_model(base, sp, groups)
    if world > 2:
        return
    check_gradients(groups)
    for sp in (False, True):  # the real run's collectives, for the parent to hold against the symbolic trace
        torch.manual_seed(0)
        model = build_model(tiny("gpt2"))
        apply_tp(model, groups, sp)
        graph, _ = trace_generation(model, PROMPT, NEW_TOKENS, Sampling(temperature=0), rank=rank, world_size=world)
        with open(f"{out_dir}/collectives.sp{int(sp)}.rank{rank}.json", "w") as f:
            json.dump(collective_signature(graph), f)


def megatron_counts(signature):
    return Counter((phase, kind) for phase, kind, *_ in signature)


def test_tp4_matches_tp1(tmp_path):
    spawn(numerics_rank, 4, (str(tmp_path),))


def test_tp2_matches_tp1_and_traces_match_symbolic(tmp_path):
    tp = 2
    spawn(numerics_rank, tp, (str(tmp_path),))
    config, n_layer, b, s, h = tiny("gpt2"), 2, 1, PROMPT.shape[1], 64
    for sp in (False, True):
        real = [json.loads((tmp_path / f"collectives.sp{int(sp)}.rank{r}.json").read_text()) for r in range(tp)]
        assert all(sig == real[0] for sig in real), "TP ranks issued different collectives"
        symbolic, _ = trace_tp_rank(config, PROMPT, NEW_TOKENS, tp, 0, sp)
        assert [list(c) for c in collective_signature(symbolic)] == real[0]
        counts = megatron_counts(real[0])
        if sp:  # embedding reduce-scatter, per layer 2 RS + 2 AG, the head's sequence gather and logits gather
            assert counts[("prefill", "reduce_scatter")] == 1 + 2 * n_layer
            assert counts[("prefill", "all_gather")] == 2 * n_layer + 2
            assert counts[("prefill", "all_reduce")] == 0
        else:  # embedding all-reduce, per layer 2 all-reduces of b*s*h*4 bytes, logits all-gather
            assert counts[("prefill", "all_reduce")] == 1 + 2 * n_layer
            assert counts[("prefill", "all_gather")] == 1
            layer_bytes = {c[4] for c in real[0] if c[0] == "prefill" and c[2].startswith("layers.")
                           and c[1] == "all_reduce"}
            assert layer_bytes == {b * s * h * 4}
        for step in range(NEW_TOKENS - 1):  # decode steps are one token: plain TP even with SP
            assert counts[(f"decode[{step}]", "all_reduce")] == 1 + 2 * n_layer
            assert counts[(f"decode[{step}]", "all_gather")] == 1
        gathered = {c[4] for c in real[0] if c[1] == "all_gather" and c[2] == "lm_head"}
        logits_bytes = b * padded_vocab(config.vocab_size, tp) * 4  # last position only, padded vocabulary
        last_positions = b * tp * h * 4  # SP prefill: each shard's last position, gathered
        assert gathered == ({logits_bytes, last_positions} if sp else {logits_bytes})


@pytest.mark.parametrize("base,sp", [("gpt2", False), ("gpt2", True), ("gptj-6b", True)])
def test_rank0_trace_stands_for_every_rank(base, sp):
    """The symbolic shortcut (trace rank 0, share it) equals tracing each rank on its own."""
    tp = 4
    derived = trace_tp_symbolic(tiny(base), PROMPT, 3, tp, sp)
    for rank in range(tp):
        own, _ = trace_tp_rank(tiny(base), PROMPT, 3, tp, rank, sp)
        shared = derived[rank]
        assert len(own) > 100 and any(True for _ in own.collectives())
        assert dict(own.nodes(data=True)) == dict(shared.nodes(data=True))
        assert sorted(own.edges(data="arg")) == sorted(shared.edges(data="arg"))
        assert own.graph == shared.graph and shared.graph["rank"] == rank


def test_tp_degree_errors_are_one_line():
    with pytest.raises(UserError, match=r"^--tp 8 is larger than tiny-gpt2's 4 attention heads"):
        check_tp(tiny("gpt2"), 8)
    heads = r"^--tp 4 does not divide tiny-gpt2's attention heads \(6\); choose --tp from 1, 2$"
    with pytest.raises(UserError, match=heads):
        check_tp(tiny_config("gpt2", n_head=6, d_head=8, d_ff=200), 4)
    with pytest.raises(UserError, match=r"FFN size \(250\)"):
        check_tp(tiny_config("gpt2", d_ff=250), 4)


def faulty_rank(spec, out_dir):
    """Rank 1 fails after joining the group; rank 0 runs the real TP entry point and would wait forever."""
    rank, _ = init_distributed("cpu")
    if rank == 1:
        raise RuntimeError("injected fault")
    tp_inference_rank(spec, out_dir, RunOutputs())


def test_a_dying_rank_stops_all_ranks_and_is_named(tmp_path):
    from syntorch.config import save_model_config
    from syntorch.inference import InferenceSpec
    save_model_config(tiny("gpt2"), tmp_path / "model.json")
    spec = InferenceSpec(model_config=str(tmp_path / "model.json"), num_input_tokens=4, num_output_tokens=2, tp=2)
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"^rank 1 failed: RuntimeError: injected fault$"):
        spawn(faulty_rank, 2, (spec, str(tmp_path)))
    assert time.monotonic() - start < 60  # generous for a loaded 2-core machine; a hang would be 300 s
    assert not (tmp_path / "run.json").exists()


def test_shards_read_lazily_from_safetensors_equal_in_memory_shards(tmp_path):
    """take_shard reads a safetensors slice (get_slice) exactly as it cuts an in-memory tensor."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    torch.manual_seed(0)
    tensors = {"qkv": torch.randn(3 * 4 * 16, 64), "rows": torch.randn(64, 256), "vocab": torch.randn(VOCAB, 64)}
    save_file(tensors, tmp_path / "w.safetensors")
    cases = [("colwise_qkv", "weight", "qkv"), ("colwise", "weight", "rows"), ("rowwise", "weight", "rows"),
             ("rowwise", "bias", "rows"), ("vocab_embedding", "weight", "vocab")]
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        for style, param, key in cases:
            for rank in range(4):
                lazy = take_shard(style, param, f.get_slice(key), rank, 4, padded_vocab(VOCAB, 4), 16)
                assert torch.equal(lazy, take_shard(style, param, tensors[key], rank, 4, padded_vocab(VOCAB, 4), 16))
    q_heads = tensors["qkv"].view(3, 4, 16, 64)[:, 2:4].reshape(-1, 64)  # rank 1 of 2 holds heads 2, 3 of q, k, v
    assert torch.equal(take_shard("colwise_qkv", "weight", tensors["qkv"], 1, 2, 256, 16), q_heads)
    vocab = take_shard("vocab_embedding", "weight", tensors["vocab"], 0, 4, 512, 16)
    assert vocab.shape == (128, 64) and torch.equal(vocab[:VOCAB], tensors["vocab"]) and not vocab[VOCAB:].any()


def test_cli_tp2_gives_tp1_tokens_and_the_comm_graph(tmp_path):
    """From a HuggingFace GPT-J checkpoint (q, k, v apart, untied head with bias): every rank keeps its shard."""
    from syntorch.checkpoints import save_checkpoint
    from syntorch.cli import main
    save_checkpoint(build_model(tiny("gptj-6b")), tmp_path / "ckpt")
    common = ["infer", "--checkpoint", str(tmp_path / "ckpt"), "--num_input_tokens", "6",
              "--num_output_tokens", "5", "--temperature", "0.8", "--seed", "5"]
    assert main(common + ["--out", str(tmp_path / "tp1")]) == 0
    assert main(common + ["--tp", "2", "--visualize_trace", "--out", str(tmp_path / "tp2")]) == 0
    tp1, tp2 = (json.loads((tmp_path / d / "run.json").read_text()) for d in ("tp1", "tp2"))
    assert tp2["output_ids"] == tp1["output_ids"] and tp2["tp"] == 2
    for name in ("tensor_trace_graph.json", "tensor_trace_graph.png", "tensor_comm_graph.png",
                 "chakra/tensor_trace_chakra.json", "chakra/ckpt.0.et", "chakra/ckpt.1.et", "chakra/comm_groups.json"):
        assert (tmp_path / "tp2" / name).stat().st_size > 0, name
