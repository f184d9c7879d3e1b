"""Generation against HuggingFace `generate` and against full recomputation, on tiny random models."""
import contextlib
import sys

import pytest
import torch
import transformers

from conftest import tiny_config
from syntorch import decode_capture
from syntorch.checkpoints import load_checkpoint
from syntorch.errors import UserError
from syntorch.generate import (Sampling, choose_tokens, generate, stream_friendly_weights, top_k_filter,
                                top_p_filter)
from syntorch.models import build_model
from syntorch.parallel.distributed import symbolic_world
from syntorch.parallel.mesh import Mesh, init_groups
from syntorch.parallel.tensor import apply_tp

GREEDY = Sampling(temperature=0)
PAD = 127  # HF needs a pad id; prompts below never contain it


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_hf(family: str):
    # a wide init makes the next-token distributions peaked, so near-ties (where float rounding could
    # legitimately pick another token) are rare and the generated text is not one repeated token
    common = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, initializer_range=0.3,
                  bos_token_id=0, eos_token_id=0)
    if family == "gptj":
        return transformers.GPTJForCausalLM(transformers.GPTJConfig(rotary_dim=8, **common)).eval()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**common)).eval()


@pytest.fixture(scope="module", params=["gpt2", "gptj"])
def pair(request, tmp_path_factory):
    """(HF model, the same weights loaded into syntorch)."""
    torch.manual_seed(0)
    hf = tiny_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_checkpoint(path)[1]


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory):
    torch.manual_seed(0)
    hf = tiny_hf("gpt2")
    path = tmp_path_factory.mktemp("gpt2-beam")
    hf.save_pretrained(path)
    return hf, load_checkpoint(path)[1]


def prompts(seed: int, batch: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(1, PAD, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_generate(hf, prompt, new_tokens, stop_tokens=(), **kwargs) -> list[list[int]]:
    """HF's sequences with the padding after a stop token removed."""
    with torch.no_grad():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=PAD, eos_token_id=list(stop_tokens) or None, **kwargs)
    return [row[:len(row) - next((i for i, t in enumerate(reversed(row)) if t != PAD), 0)] for row in out.tolist()]


@pytest.mark.parametrize("captured", [False, True])  # decode steps eager, or replayed from decode_capture's trace
def test_greedy_matches_hf(pair, captured, monkeypatch):
    monkeypatch.setattr(decode_capture, "MIN_STEPS", 1 if captured else sys.maxsize)
    hf, model = pair
    for seed in range(3):
        prompt = prompts(seed)
        assert generate(model, prompt, 20, GREEDY).tokens == hf_generate(hf, prompt, 20)


def test_greedy_with_stop_tokens_matches_hf(gpt2_pair):
    hf, model = gpt2_pair
    prompt = prompts(1)
    free = generate(model, prompt, 20, GREEDY).tokens[0]
    stop = (free[10],)  # a token row 0 produces mid-way
    ours = generate(model, prompt, 20, GREEDY, stop_tokens=stop).tokens
    assert ours[0] == free[:free.index(stop[0], 6) + 1]
    assert ours == hf_generate(hf, prompt, 20, stop)


@pytest.mark.parametrize("stop_tokens", [(), (8, 17, 90)])
def test_beam_search_matches_hf(gpt2_pair, stop_tokens):
    hf, model = gpt2_pair
    lengths, differs_from_greedy = set(), False
    for seed in range(4):
        prompt = prompts(seed, length=5)
        ours = generate(model, prompt, 16, GREEDY, stop_tokens=stop_tokens, beam_width=4).tokens
        assert ours == hf_generate(hf, prompt, 16, stop_tokens, num_beams=4)
        differs_from_greedy |= ours != generate(model, prompt, 16, GREEDY, stop_tokens=stop_tokens).tokens
        lengths |= {len(row) for row in ours}
    assert differs_from_greedy
    assert len(lengths) > 1 if stop_tokens else lengths == {21}  # the stop tokens did end some beams


def test_beam_width_3_matches_hf(pair):
    hf, model = pair
    prompt = prompts(7, length=5)
    assert generate(model, prompt, 12, GREEDY, beam_width=3).tokens == hf_generate(hf, prompt, 12, num_beams=3)


def test_cached_decode_equals_full_recompute(pair):
    _, model = pair
    step_logits = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: step_logits.append(out[:, -1]))
    try:
        result = generate(model, prompts(3), 12, Sampling(temperature=1.0, seed=0))
    finally:
        hook.remove()
    tokens = torch.tensor(result.tokens)
    with torch.no_grad():
        full = model(tokens[:, :-1])  # no cache: every position recomputed
    assert len(step_logits) == 12
    # logits reach ~8 here: either way is ~1.5e-5 from a float64 run (one-row and many-row products round apart)
    for i, logits in enumerate(step_logits):
        torch.testing.assert_close(logits, full[:, 5 + i], rtol=1e-5, atol=5e-5)


def test_stream_friendly_weights_keep_values_shapes_and_tying():
    model = build_model(tiny_config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        expected = model(prompts(8))
    stream_friendly_weights(model)
    stream_friendly_weights(model)  # idempotent: a second call must not transpose back
    assert not model.layers["0"].mlp.fc1.weight.is_contiguous()
    assert model.lm_head.weight is model.tok_emb.weight
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len({w.untyped_storage().data_ptr() for w in linears}) == 1  # one buffer (on huge pages where offered)
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(prompts(8)), expected)


def test_batch_equals_each_row_alone(gpt2_pair):
    _, model = gpt2_pair
    prompt = prompts(5, batch=3)
    for beam_width in (1, 4):
        together = generate(model, prompt, 10, GREEDY, stop_tokens=(8,), beam_width=beam_width).tokens
        alone = [generate(model, row[None], 10, GREEDY, stop_tokens=(8,), beam_width=beam_width).tokens[0]
                 for row in prompt]
        assert together == alone


def test_same_seed_same_tokens(gpt2_pair):
    _, model = gpt2_pair
    prompt = prompts(2)

    def run(seed):
        return generate(model, prompt, 15, Sampling(temperature=1.5, top_k=50, top_p=0.95, seed=seed)).tokens

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_top_k_1_and_tiny_top_p_are_greedy(gpt2_pair):
    _, model = gpt2_pair
    prompt = prompts(4)
    greedy = generate(model, prompt, 15, GREEDY).tokens
    assert generate(model, prompt, 15, Sampling(temperature=2.0, top_k=1, seed=1)).tokens == greedy
    assert generate(model, prompt, 15, Sampling(temperature=2.0, top_p=1e-6, seed=1)).tokens == greedy
    assert generate(model, prompt, 15, Sampling(temperature=2.0, seed=1)).tokens != greedy


def smallest_set_with_mass(probs: torch.Tensor, p: float) -> set[int]:
    """Brute force: add tokens from the most likely down until their mass reaches p."""
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i].item()):
        if mass >= p:
            break
        kept.add(i)
        mass += probs[i].item()
    return kept


def test_top_p_keeps_the_smallest_set_with_enough_mass():
    logits = torch.tensor([0.1, 0.5, 0.05, 0.3, 0.05]).log()
    kept = lambda p: set(torch.isfinite(top_p_filter(logits, p)).nonzero().flatten().tolist())  # noqa: E731
    assert kept(0.4) == {1}
    assert kept(0.7) == {1, 3}
    assert kept(0.85) == {0, 1, 3}
    assert kept(1.0) == {0, 1, 2, 3, 4}
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(40, generator=g) * 3
        p = torch.rand((), generator=g).item()
        assert kept(p) == smallest_set_with_mass(logits.softmax(-1), p)


def test_top_k_filter_and_sampling_stay_in_the_top_k():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    top3 = logits.topk(3).indices
    filtered = top_k_filter(logits, 3)
    assert torch.isfinite(filtered).sum(-1).tolist() == [3] * 4
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        chosen = choose_tokens(logits, Sampling(temperature=5.0, top_k=3), g)
        assert (top3 == chosen[:, None]).any(-1).all()


def test_stop_tokens_end_sequences_and_generation(gpt2_pair):
    _, model = gpt2_pair
    prompt = prompts(6)
    free = generate(model, prompt, 20, GREEDY).tokens
    stops = (free[0][8], free[1][12])
    result = generate(model, prompt, 20, GREEDY, stop_tokens=stops)
    for row, full in zip(result.tokens, free):
        end = min(full.index(s, 6) for s in stops if s in full[6:]) + 1
        assert row == full[:end]
    assert len(result.decode_s) == max(map(len, result.tokens)) - 6 - 1  # no step after every row stopped


def test_meta_runs_symbolically_with_phases():
    model = build_model(tiny_config("gptj-6b"), device="meta")
    phases = []

    def scope(phase):
        phases.append(phase)
        return contextlib.nullcontext()

    prompt = torch.zeros(2, 5, dtype=torch.long, device="meta")
    result = generate(model, prompt, 4, Sampling(seed=0), stop_tokens=(0,), phase_scope=scope)
    assert phases == ["prefill", "decode[0]", "decode[1]", "decode[2]"]
    assert result.tokens == [[0] * 9] * 2 and len(result.decode_s) == 3
    assert generate(model, prompt, 3, GREEDY, beam_width=2).tokens == [[0] * 8] * 2
    assert all(attn.kv_cache is None for attn in (b.attn for b in model.layers.values()))


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_is_a_user_error(kwargs):
    with pytest.raises(UserError):
        Sampling(**kwargs)


def test_bad_request_is_a_user_error():
    model = build_model(tiny_config(), device="meta")  # n_positions 64
    prompt = torch.zeros(1, 60, dtype=torch.long, device="meta")
    with pytest.raises(UserError, match="exceed the context"):
        generate(build_model(tiny_config()), torch.zeros(1, 60, dtype=torch.long), 5)
    # symbolic runs may pass the context (cost studies such as 2048 + 4 tokens on GPT-3): warned, not refused
    assert len(generate(model, prompt, 5).tokens[0]) == 65
    with pytest.raises(UserError, match="new tokens must be positive"):
        generate(model, prompt, 0)
    with pytest.raises(UserError, match="beam_width"):
        generate(model, prompt, 1, beam_width=0)


@pytest.mark.parametrize("seq", [2, 4, 6])
def test_last_only_is_one_position_under_sequence_parallel(seq):
    """Under --sp each of the 2 TP ranks holds seq/2 positions; with one each (a prompt as long as the TP
    degree) the head returned every position instead of the last."""
    config = tiny_config()
    with symbolic_world(0, 2):
        model = build_model(config, device="meta")
        apply_tp(model, init_groups(Mesh(tp=2)), sequence_parallel=True)
        idx = torch.zeros(3, seq, dtype=torch.long, device="meta")
        assert model(idx, last_only=True).shape == (3, 1, config.vocab_size)
        assert model(idx).shape == (3, seq, config.vocab_size)


def test_generate_leaves_the_callers_weights_alone():
    """Not their values, nor their memory (a training loop, an optimizer or a flat buffer may hold it)."""
    model = build_model(tiny_config())
    before = {name: (p.data_ptr(), p.stride(), p.detach().clone()) for name, p in model.named_parameters()}
    generate(model, prompts(1), 3, GREEDY)
    generate(model, prompts(2), 3, GREEDY, beam_width=2)
    for name, p in model.named_parameters():
        ptr, stride, value = before[name]
        assert (p.data_ptr(), p.stride()) == (ptr, stride), name
        torch.testing.assert_close(p.detach(), value, rtol=0, atol=0)
    assert model.lm_head.weight is model.tok_emb.weight


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_logits_stop_sampling_naming_the_step(value):
    model = build_model(tiny_config("gpt2"))
    calls = []

    def spoil_second_step(_module, _args, out):
        calls.append(1)
        return out * value if len(calls) == 2 else out
    model.lm_head.register_forward_hook(spoil_second_step)
    with pytest.raises(UserError, match="the logits of generated token 2 are not finite"):
        generate(model, torch.zeros(1, 4, dtype=torch.long), 4, Sampling(temperature=0.7, seed=0))


def test_a_temperature_below_float32s_reach_samples_greedily():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    tiny = Sampling(temperature=1e-300, seed=0)
    assert tiny.greedy and choose_tokens(logits, tiny, torch.Generator()).tolist() == [1]
