"""DeepSeek-V2, V2-Lite and V3 against transformers (tiny random models written here): HF folders load as they are
with the same logits, greedy and beam tokens; saved ones load back into transformers. MLA's cache holds the
latent; the registry's shapes give the published parameter counts; TP and EP equal one process."""
import copy
import json

import pytest
import torch
import transformers as hf
from plan_steps import reference_step

from syntorch.checkpoints import load_checkpoint
from syntorch.config import get_config
from syntorch.generate import Sampling, generate
from syntorch.models import build_model
from syntorch.models.moe import MoE
from syntorch.parallel.launch import init_distributed, spawn
from syntorch.parallel.mesh import Mesh, init_groups
from syntorch.parallel.plans import TrainPlan
from syntorch.parallel.tensor import apply_tp, reduce_partial_grads
from syntorch.trace.training import trace_stage
from tests.conftest import in_turn, tiny_config
from tests.parallel.test_expert_parallel import EP2, ep_rank
# collected here with this module's `pair`: greedy and beam tokens equal transformers' (decode steps run MLA's
# absorbed form over the cached latent, reordered between beams); saved folders load back into transformers
from tests.models.test_llama import test_greedy_and_beam_tokens_match_transformers  # noqa: F401
from tests.models.test_llama import test_save_round_trip_through_transformers  # noqa: F401
from tests.models.test_llama import VOCAB, ids
from tests.models.test_llama import randomized as wide

GREEDY = Sampling(temperature=0)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, first_k_dense_replace=1,
              max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
              pad_token_id=VOCAB - 1)
# YaRN over a short original context with a fractional ramp (truncate False) and mscale != mscale_all_dim, so
# that scaled, kept and blended frequencies, the rotary gain and the softmax mscale all occur
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=4.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=0.8, truncate=False)
FAMILIES = ["v3", "v3-half", "v2", "v2-lite"]

pytestmark = pytest.mark.usefixtures("one_thread")


def make(family: str):
    """V3: sigmoid routing with a correction bias over 4 groups of 2 (top 2 groups), q LoRA, rotary on pairs
    (or, v3-half, on halves: HF's rope_interleave false); V2: softmax routing limited to 2 of 4 groups, q LoRA,
    2 shared experts; V2-Lite: greedy softmax, no q LoRA."""
    if family.startswith("v3"):
        config = hf.DeepseekV3Config(q_lora_rank=24, n_group=4, topk_group=2, n_shared_experts=1,
                                     routed_scaling_factor=2.5, norm_topk_prob=True, rope_scaling=YARN,
                                     rope_interleave=family == "v3", **COMMON)
        return hf.DeepseekV3ForCausalLM(config)
    lite = family == "v2-lite"
    config = hf.DeepseekV2Config(q_lora_rank=None if lite else 24, n_group=1 if lite else 4,
                                 topk_group=1 if lite else 2,
                                 topk_method="greedy" if lite else "group_limited_greedy", n_shared_experts=2,
                                 routed_scaling_factor=1.0 if lite else 16.0, norm_topk_prob=False, rope_scaling=YARN,
                                 **COMMON)
    return hf.DeepseekV2ForCausalLM(config)


def randomized(model):
    """test_llama's wide random weights, and V3's correction bias too: a routing choice that ignores it, or a
    weight that includes it, moves logits well beyond the tolerance."""
    model = wide(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(family, HF model, folder it saved, our model loaded from it)."""
    model = randomized(make(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, model, folder, load_checkpoint(folder)[1]


def test_logits_match_transformers(pair):
    _, model, _, ours = pair
    with torch.no_grad():
        ref = model(ids()).logits
        mine = ours(ids())
    assert ref.abs().max() > 1
    assert (mine - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_cache_holds_the_latent_and_decode_equals_a_full_forward(pair):
    """The cache holds kv_lora_rank + rotary dims per token (one shared 'head'), not per-head K/V; a decode step
    through it (absorbed) gives the logits a full forward over the same tokens gives (expanded)."""
    _, _, _, ours = pair
    ours.setup_caches(2, 20)
    cache = ours.layers["0"].attn.kv_cache
    assert (cache.k.shape, cache.v.shape) == ((2, 1, 20, 16), (2, 1, 20, 8))
    tokens = ids(length=9, seed=3)
    with torch.no_grad():
        ours(tokens[:, :8])
        step = ours(tokens[:, 8:], start=8)
        ours.reset_caches()
        full = ours(tokens)
    assert (step[:, 0] - full[:, 8]).abs().max().item() <= 1e-5 * full.abs().max().item()


def test_config_mapping(pair):
    family, _, _, ours = pair
    c = ours.config
    assert (c.d_head, c.rotary_dim, c.value_head_dim, c.kv_lora_rank) == (24, 8, 12, 16)
    assert c.q_lora_rank == (0 if family == "v2-lite" else 24)
    assert c.rotary_style == ("half" if family == "v3-half" else "interleaved")
    assert c.moe_topk_method == {"v2": "group_limited_greedy", "v2-lite": "greedy"}.get(family, "noaux_tc")
    assert (c.rope_scaling, c.rope_factor, c.rope_mscale_all_dim, c.rope_truncate) == ("yarn", 4.0, 0.8, False)
    assert not isinstance(ours.layers["0"].mlp, MoE) and isinstance(ours.layers["1"].mlp, MoE)


def counts(name):
    """(total, active) parameters on meta. Active: what one token's forward multiplies by (attention, dense MLPs,
    shared experts, routers, its top-k routed experts, the head), not the input embedding, which is a lookup."""
    c = get_config(name)
    model = build_model(c, device="meta")
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters())
    active = total - routed + routed // c.n_experts * c.moe_top_k - model.tok_emb.weight.numel()
    return total, active


@pytest.mark.parametrize("name,total,active", [
    # published: DeepSeek-V3 report (arXiv 2412.19437) §1: 671B total, 37B activated, the main model without the
    # 14B multi-token-prediction module (the HF checkpoint's 685B holds it); DeepSeek-V2 (arXiv 2405.04434): 236B
    # and 21B; DeepSeek-V2-Lite model card: 15.7B and 2.4B
    ("deepseek-v3", 671e9, 37e9), ("deepseek-v2", 236e9, 21e9), ("deepseek-v2-lite", 15.7e9, 2.4e9),
])
def test_registry_parameter_counts(name, total, active):
    mine_total, mine_active = counts(name)
    assert abs(mine_total - total) <= 0.5e9 if total > 100e9 else abs(mine_total - total) <= 0.05e9
    # the active figures are rounded: V3 36.6B, V2 20.9B, V2-Lite 2.45B
    assert abs(mine_active - active) <= 0.025 * active


# ---- tensor and expert parallelism on gloo ranks, against one process

def tiny(base, **kw):
    return tiny_config(base, n_layer=3, n_head=4, d_head=24, rotary_dim=8, v_head_dim=12, kv_lora_rank=16,
                       n_experts=8, d_ff_expert=32, d_ff=64, moe_top_k=3, first_k_dense=1, rope_original_positions=16,
                       **kw)


TINY = {"v3": tiny("deepseek-v3", q_lora_rank=24, moe_n_group=4, moe_topk_group=2),
        "v2-lite": tiny("deepseek-v2-lite")}
PROMPT = torch.tensor([[5, 17, 99, 3, 42, 8, 0, 64]])


def close(what, got, want, tol=1e-5):
    err = (got - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), f"{what}: max abs error {err:.2e}"


def tp_check(name, groups):
    full = randomized(build_model(TINY[name]))  # wide weights: sharp routing and attention, so a wrong shard shows
    model = copy.deepcopy(full)
    plan = apply_tp(model, groups)
    r, n = groups.tp_rank, groups.mesh.tp
    attn = model.layers["1"].attn
    assert attn.kv_b.weight.shape[0] == 4 // n * (16 + 12) and attn.kv_a.weight.shape[0] == 16 + 8  # heads split
    idx = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        close(name, model(idx), full(idx))
    for beams in (1, 2):
        want = generate(full, PROMPT, 5, GREEDY, beam_width=beams).tokens
        assert generate(model, PROMPT, 5, GREEDY, beam_width=beams).tokens == want, name
    full.train(), model.train()
    full(idx).square().mean().backward()
    model(idx).square().mean().backward()
    reduce_partial_grads(model, plan, groups)
    for replicated in ("attn.kv_a", "attn.kv_norm", "mlp.router", *(("attn.q_a",) if name == "v3" else ())):
        assert f"layers.1.{replicated}.weight" in plan.partial_grads, (replicated, plan.partial_grads)
        close(f"{name} {replicated} grad", model.get_submodule(f"layers.1.{replicated}").weight.grad,
              full.get_submodule(f"layers.1.{replicated}").weight.grad)
    for sharded in ("attn.kv_b", "attn.q_b" if name == "v3" else "attn.q"):
        close(f"{name} {sharded} grad", model.get_submodule(f"layers.1.{sharded}").weight.grad,
              full.get_submodule(f"layers.1.{sharded}").weight.grad.chunk(n)[r])
    close(f"{name} proj grad", attn.proj.weight.grad, full.layers["1"].attn.proj.weight.grad.chunk(n, 1)[r])


def tp_rank():
    rank, world = init_distributed("cpu")
    groups = init_groups(Mesh(tp=world))
    for name in TINY:
        tp_check(name, groups)


@pytest.fixture(scope="module")
def real_ranks(tmp_path_factory):
    """Both real checks on one launch of 2 ranks: TP first, on the RNG state a fresh rank starts with, then the EP
    step, which seeds itself. Raises if a rank's TP check fails."""
    out = tmp_path_factory.mktemp("deepseek_ranks")
    spawn(in_turn, 2, ((tp_rank, ()), (ep_rank, (str(out), TINY["v3"]))))
    return out


def test_tp2_equals_one_process(real_ranks):
    """MLA split by heads (q LoRA or not), dense first layer and MoE layers: logits, greedy and beam tokens,
    and the gradients of replicated (summed over TP) and sharded weights equal one process (checked in the
    ranks, by tp_check)."""
    assert all((real_ranks / f"rank{r}.json").is_file() for r in range(2))  # the ranks went on past their TP checks


def test_ep2_step_equals_one_process(real_ranks):
    """DeepSeek-V3's routing (sigmoid, groups, correction bias) with the routed experts split over 2 EP ranks: the
    loss and every gradient equal one process's step over the same global batch."""
    ranks = [json.loads((real_ranks / f"rank{r}.json").read_text()) for r in range(2)]
    ref_loss, ref_grads, _ = reference_step(TINY["v3"], EP2)
    assert (ranks[0]["loss"] + ranks[1]["loss"]) / 2 == pytest.approx(ref_loss, abs=1e-5)
    for name, grad in ref_grads.items():
        holders = [r["grads"][name] for r in ranks if name in r["grads"]]
        assert len(holders) == (1 if ".experts." in name else 2), name
        for g in holders:
            torch.testing.assert_close(torch.tensor(g), grad, atol=1e-5, rtol=1e-4)


def test_symbolic_tp_trace_has_dense_then_moe_layers_and_one_all_reduce_per_region():
    """On meta under TP 2: layer 0's dense MLP and layer 1's experts are both traced (not layer 0 copied), each
    MLA layer and each MLP/MoE layer is one TP region (one all-reduce each), and decode reads the latent cache."""
    from collections import Counter

    from syntorch.trace.generation import trace_tp_rank
    graph, _ = trace_tp_rank(TINY["v3"], PROMPT, 2, 2, 0, False)
    modules = {d.get("module", "") for _, d in graph.nodes(data=True)}
    assert any(m.startswith("layers.0.mlp.fc1") for m in modules)
    assert any(m.startswith("layers.1.mlp.experts.") for m in modules)
    assert not any(m.startswith("layers.0.mlp.experts.") for m in modules)
    per_module = Counter((d["phase"], d["module"]) for _, d in graph.collectives() if d["module"].startswith("layers"))
    assert per_module == {(phase, f"layers.{i}.{part}"): 1 for phase in ("prefill", "decode[0]") for i in range(3)
                          for part in ("attn", "mlp")}
    cache = [d for _, d in graph.nodes(data=True) if d.get("kind") == "tensor" and "kv_cache.k" in d.get("name", "")]
    assert cache and all(d["shape"][1:] == [1, 10, 16] for d in cache)  # [B, 1, positions, kv_lora_rank]


def test_trace_command_with_ep_validates(tmp_path):
    """`syntorch trace --model_config small.json --ep 2 --dp 2`: the routed experts' all-to-alls over EP, the
    traces valid for ASTRA-sim."""
    from syntorch.chakra.validator import check_traces
    from syntorch.cli import main
    from syntorch.config import save_model_config
    save_model_config(TINY["v3"], tmp_path / "small.json")
    out = tmp_path / "run"
    assert main(["trace", "--model_config", str(tmp_path / "small.json"), "--ep", "2", "--dp", "2", "--seq", "16",
                 "--out", str(out), "--no_progress"]) == 0
    assert check_traces(out)[0] == []
    assert "all_to_all" in {d["collective"] for _, d in trace_stage(TINY["v3"], EP2, 0).collectives()}


def test_int8_weight_only_keeps_the_router_and_kv_b():
    """--quant int8_weight_only quantizes MLA's projections and the experts but, as vLLM, not DeepSeek's FP32
    router or kv_b (the absorbed decode multiplies by its halves); prefill and decode then stay close to FP32."""
    from syntorch.quant import quantize_int8_weight_only
    full = build_model(TINY["v3"])
    model = copy.deepcopy(full)
    done = quantize_int8_weight_only(model)
    assert "layers.1.attn.q_b" in done and "layers.1.mlp.experts.0.fc1" in done
    assert not any(name.endswith(("router", "kv_b")) for name in done)
    tokens = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        want = full(tokens)
        model.setup_caches(1, 9)
        model(tokens[:, :8])
        step = model(tokens[:, 8:], start=8)  # the absorbed form over int8 q_b and proj
        model.reset_caches()
    close("int8 decode", step[:, 0], want[:, 8], 0.05)


def test_mla_layer_activations_from_its_shapes():
    """DeepSeek-V3's MLA at TP 8 with SP, bf16, per token (memory.py's conventions: flash attention, what backward
    reads): outside the TP regions, over t, the norms' inputs and outputs (4h), the latents q_a and its norm's
    output (2 x 1536), kv_a's latent and rotary key (512 + 64) and the latent norm's output (512); inside, over t,
    Q (128 heads x 192) and the attention output (128 x 128), the MoE's routed copies (2 x 8 x h, outside) and
    the intermediates of 8 routed + 1 shared experts (3 x 2048 each); K and V (128 x (192 + 128)) over t."""
    from syntorch.parallel import memory
    h, t = 7168, 8
    outside = 4 * h + 2 * 1536 + 2 * 512 + 64 + 2 * 8 * h
    inside = 128 * (192 + 128) + 3 * 9 * 2048
    per_token = 2 * (outside / t + inside / t + 128 * (192 + 128) / t)
    plan = TrainPlan(tp=t, sp=True, seq=4096)
    assert memory.layer_activation_bytes(get_config("deepseek-v3"), plan, 2) == pytest.approx(4096 * per_token,
                                                                                            rel=1e-12)


@pytest.mark.parametrize("family,change,message", [
    ("v3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config 'fp8' weights are not supported"),
    ("v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc' is not supported"),
    ("v2", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid' is not supported"),
    ("v3", {"rope_scaling": {"rope_type": "llama3", "factor": 4.0}}, "rope_scaling type 'llama3' is not supported"),
    ("v3", {"n_group": 3}, r"moe_n_group \(3\) must divide n_experts \(8\)"),
    ("v3", {"n_shared_experts": None}, "n_shared_experts must be a positive integer"),
])
def test_bad_configs_are_one_line(family, change, message):
    from syntorch.errors import UserError
    from syntorch.hf_format import hf_config_to_model_config
    config = {**make(family).config.to_dict(), **change}
    with pytest.raises(UserError, match=message) as e:
        hf_config_to_model_config(json.loads(json.dumps(config)))
    assert "\n" not in str(e.value)
