"""The captured CPU decode step (syntorch/decode_capture.py) generates what eager decoding does, and is used
only where one traced step holds every later one."""
import contextlib
import dataclasses

import pytest
import torch

import syntorch.decode_capture as capture
from conftest import tiny_config
from syntorch.decode_capture import CapturedForward, capturable
from syntorch.generate import LocalForward, Sampling, generate
from syntorch.models import build_model
from syntorch.models.layers import init_weights


def recomputed(model, prompt: torch.Tensor, steps: int) -> list[int]:
    """Greedy tokens without a cache: every step recomputes the whole sequence (an independent reference)."""
    with torch.inference_mode():
        ids = prompt
        for _ in range(steps):
            ids = torch.cat((ids, model(ids)[:, -1:].argmax(-1)), 1)
    return ids[0].tolist()


# learned positions; rotary (Llama 3.1's scaling) with grouped-query attention; GPT-J's parallel residual
@pytest.mark.parametrize("base, kv", [("gpt2", 4), ("llama-3.1-405b", 2), ("gptj-6b", 4)])
def test_the_captured_steps_generate_what_recomputing_the_sequence_does(base, kv, one_thread):
    model = build_model(tiny_config(base, n_kv_head=kv))
    init_weights(model, std=0.5)  # sharp logits: a step at the wrong slot or position picks other tokens
    prompt = torch.randint(0, 128, (1, 5))
    forward = CapturedForward(5 + 12, LocalForward())
    tokens = generate(model, prompt, 12, Sampling(temperature=0), forward=forward).tokens[0]
    assert forward.step is not None and not forward.failed  # the later steps ran the traced graph
    assert tokens == recomputed(model, prompt, 12)
    assert all(p.requires_grad for p in model.parameters())  # as they were before the trace


def test_a_step_that_cannot_be_traced_decodes_eagerly(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("not traceable")

    monkeypatch.setattr(torch.jit, "trace", fail)
    model = build_model(tiny_config("gpt2"))
    init_weights(model, std=0.5)
    prompt = torch.randint(0, 128, (1, 5))
    forward = CapturedForward(5 + 6, LocalForward())
    tokens = generate(model, prompt, 6, Sampling(temperature=0), forward=forward).tokens[0]
    assert tokens == recomputed(model, prompt, 6)
    assert forward.failed and all(p.requires_grad for p in model.parameters())


def test_generate_captures_only_runs_long_enough_to_pay_for_it(monkeypatch, one_thread):
    model = build_model(tiny_config("gpt2"))
    made, original = [], CapturedForward.__init__

    def spy(self, max_seq, eager):
        made.append(max_seq)
        original(self, max_seq, eager)

    monkeypatch.setattr(CapturedForward, "__init__", spy)
    prompt = torch.randint(0, 128, (1, 4))
    monkeypatch.setattr(capture, "MIN_STEPS", 8)
    short = generate(model, prompt, 8, Sampling(temperature=0)).tokens  # 7 decode steps
    assert made == []
    long = generate(model, prompt, 9, Sampling(temperature=0)).tokens
    assert made == [4 + 9] and long[0][:-1] == short[0]


def test_only_steps_a_trace_holds_are_captured():
    gpt2 = build_model(tiny_config("gpt2"))
    cpu, steps = torch.device("cpu"), capture.MIN_STEPS
    assert capturable(gpt2, cpu, steps) and not capturable(gpt2, cpu, steps - 1)
    assert not capturable(gpt2, torch.device("meta"), steps)
    # the mask depends on the slot
    windowed = build_model(dataclasses.replace(tiny_config("mistral-7b", n_kv_head=2), sliding_window=8))
    assert not capturable(windowed, cpu, steps)
    assert not capturable(build_model(tiny_config("mixtral-8x7b", n_kv_head=2)), cpu, steps)  # data-dependent routing


def test_traced_runs_and_capture_false_stay_eager(monkeypatch):
    """A tracer's run (phase_scope: its module hooks must run) and capture=False never capture."""
    made = []
    monkeypatch.setattr(capture, "MIN_STEPS", 2)
    monkeypatch.setattr(CapturedForward, "logits", lambda *a: made.append(1))
    model, prompt = build_model(tiny_config("gpt2")), torch.randint(0, 128, (1, 4))
    generate(model, prompt, 4, Sampling(temperature=0), phase_scope=lambda name: contextlib.nullcontext())
    generate(model, prompt, 4, Sampling(temperature=0), capture=False)
    assert made == []
