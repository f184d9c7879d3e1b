"""Derived decode steps (trace/decode_steps.py) against fully traced ones: every node's attributes, every
edge, the graph attributes and the result, for greedy, sampling, beam search, a ragged batch, GQA, a sliding
window, TP and PP stages; only the first steps run; a run whose rule fails is traced in full; and
`syntorch infer --device meta` writes the same files either way."""
import filecmp
import logging

import pytest
import torch

from conftest import tiny_config
from syntorch.generate import Sampling, generate
from syntorch.inference import InferenceSpec, RunOutputs, run_inference
from syntorch.models import build_model
from syntorch.parallel.mesh import Mesh
from syntorch.trace import decode_steps, trace_generation
from syntorch.trace.generation import trace_pp_stage, trace_tp_rank
from syntorch.trace.tracer import SDPA

T, NEW = 5, 16  # prefill, decode[0] .. decode[14]: decode[5] .. decode[14] derived (decode[7].. with a window)
GREEDY = Sampling(temperature=0)


@pytest.fixture(autouse=True)
def derived_not_retraced(caplog):
    """Every derivation here holds: no run falls back to tracing all its steps (unless a test says so)."""
    caplog.set_level(logging.INFO, logger="syntorch.trace.generation")
    yield
    assert "not derivable" not in caplog.text


def assert_same(derived, full):
    assert len(derived) == len(full) > 0
    assert dict(derived.nodes(data=True)) == dict(full.nodes(data=True))
    assert sorted(derived.edges(data="arg")) == sorted(full.edges(data="arg"))
    assert derived.graph == full.graph


def traced_both(base, overrides=None, **kwargs):
    model = build_model(tiny_config(base, **(overrides or {})), device="meta")
    prompt = torch.zeros(2, T, dtype=torch.long, device="meta")
    full = trace_generation(model, prompt, NEW, derive=False, **kwargs)
    return trace_generation(model, prompt, NEW, **kwargs), full


CASES = {
    "greedy": ("gpt2", None, dict(sampling=GREEDY)),
    "sampled": ("gpt2", None, dict(sampling=Sampling(temperature=0.8, top_k=5, top_p=0.9, seed=1))),
    "beam": ("gpt2", None, dict(sampling=GREEDY, beam_width=2)),  # every decode step reorders the cache
    "ragged": ("gpt2", None, dict(sampling=GREEDY, pads=[0, 2])),  # masks over the keys grow each step
    "gqa": ("llama-2-7b", dict(n_kv_head=2), dict(sampling=GREEDY)),
    "one layer": ("gptj-6b", dict(n_layer=1), dict(sampling=GREEDY)),  # nothing replicated
    "window": ("mistral-7b", dict(n_kv_head=2, sliding_window=8), dict(sampling=GREEDY)),  # cuts from decode[3]
    "moe": ("mixtral-8x7b", dict(n_kv_head=2, n_experts=4, d_ff_expert=32), dict(sampling=GREEDY)),
    # latent attention, a dense first layer (layers unlike: nothing replicated)
    "mla": ("deepseek-v3", dict(n_layer=3, d_head=24, v_head_dim=12, kv_lora_rank=16, q_lora_rank=24, n_experts=8,
                                d_ff_expert=32, moe_top_k=2, moe_n_group=4, moe_topk_group=2, first_k_dense=1,
                                rope_original_positions=16), dict(sampling=GREEDY)),
    # windowed and full layers alternating, attention sinks
    "gpt-oss": ("gpt-oss-20b", dict(n_kv_head=2, n_experts=4, d_ff_expert=32, sliding_window=8),
                dict(sampling=GREEDY)),
}


@pytest.mark.parametrize("case", CASES)
def test_derived_steps_equal_traced_steps(case):
    base, overrides, kwargs = CASES[case]
    generation = decode_steps.SymbolicGeneration(T, (0, 0), NEW)
    assert generation.stop_step(tiny_config(base, **(overrides or {}))) is not None  # steps are left to derive
    (derived, result), (full, full_result) = traced_both(base, overrides, **kwargs)
    assert_same(derived, full)
    assert result.tokens == full_result.tokens and result.prompt_lens == full_result.prompt_lens
    assert len(result.decode_s) == len(full_result.decode_s) == NEW - 1


def test_attention_reads_every_key_so_far_in_each_derived_step():
    """Independent of a full trace: decode[i] attends over T + i + 1 cached keys, in every layer."""
    (graph, _), _ = traced_both("gpt2", sampling=GREEDY)
    for i in range(NEW - 1):
        attention = [n for n, d in graph.ops() if d["phase"] == f"decode[{i}]" and d["name"] == SDPA]
        assert len(attention) == 2  # one per layer
        for op in attention:
            keys = [graph.nodes[t]["shape"] for t in graph.predecessors(op)][1]  # query, key, value
            assert keys == [2, 4, T + i + 1, 16]


def test_only_the_first_decode_steps_run(monkeypatch):
    steps = []
    real_call = decode_steps.StepScope.__call__

    def noting(scope, name):
        steps.append(name)
        return real_call(scope, name)
    monkeypatch.setattr(decode_steps.StepScope, "__call__", noting)
    traced_both("gpt2", sampling=GREEDY)
    assert steps == ["prefill"] + [f"decode[{i}]" for i in range(6)]  # decode[5] stopped the run


def test_a_rule_that_misses_a_step_falls_back_to_tracing_all(monkeypatch, caplog):
    """A window cutting from decode[3] on, with the rule made from decode[2] and decode[3]: it cannot
    rebuild decode[4], so every step is traced."""
    monkeypatch.setattr(decode_steps.SymbolicGeneration, "first_rule_step", lambda self, config: 2)
    (derived, _), (full, _) = traced_both("mistral-7b", dict(n_kv_head=2, sliding_window=8), sampling=GREEDY)
    assert_same(derived, full)
    assert "not derivable" in caplog.text
    caplog.clear()


def test_real_devices_trace_every_step():
    model = build_model(tiny_config("gpt2"))
    prompt = torch.randint(0, 128, (1, T))
    graph, result = trace_generation(model, prompt, NEW, GREEDY)
    assert result.tokens == generate(model, prompt, NEW, GREEDY).tokens
    assert {d["phase"] for _, d in graph.ops()} == {"prefill"} | {f"decode[{i}]" for i in range(NEW - 1)}


def test_tp_rank_and_pp_stages():
    config = tiny_config("gpt2", n_layer=4)
    prompt = torch.zeros(4, T, dtype=torch.long)
    full = trace_tp_rank(config, prompt, NEW, tp=2, rank=1, sampling=GREEDY, derive=False)[0]
    assert_same(trace_tp_rank(config, prompt, NEW, tp=2, rank=1, sampling=GREEDY)[0], full)

    def run(m, scope, forward, new=NEW):
        return generate(m, prompt.to("meta"), new, GREEDY, phase_scope=scope, forward=forward)
    mesh = Mesh(pp=2, tp=2)
    generation = decode_steps.SymbolicGeneration(T, (0,) * 4, NEW)
    for stage in range(2):  # micro-batches, sends and recvs with their tags, the chosen tokens' broadcast
        derived = trace_pp_stage(config, run, mesh, stage, generation=generation)[0]
        assert_same(derived, trace_pp_stage(config, run, mesh, stage)[0])


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, pp=2, beam_width=2)])
def test_infer_writes_the_same_files_as_tracing_every_step(tmp_path, monkeypatch, layout):
    """run.json, images, Chakra, the prediction and its timeline, the collective report."""
    spec = InferenceSpec(model="gpt2", device="meta", batch_size=4, num_input_tokens=T, num_output_tokens=NEW,
                         **layout)
    outputs = RunOutputs(visualize=layout.get("pp", 1) == 1, chakra=True, hw_config="h100-sxm", comm_debug=1)
    derived = run_inference(spec, tmp_path / "derived", outputs)
    monkeypatch.setattr(decode_steps.SymbolicGeneration, "first_rule_step", lambda self, config: NEW)
    full = run_inference(spec, tmp_path / "full", outputs)
    assert derived == full
    files = sorted(str(p.relative_to(tmp_path / "full")) for p in (tmp_path / "full").rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(tmp_path / "derived")) for p in (tmp_path / "derived").rglob("*")
                  if p.is_file()) == files and "chakra/gpt2.1.et" in files
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "derived", tmp_path / "full", files, shallow=False)
    assert not mismatch and not errors
