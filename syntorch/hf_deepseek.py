"""DeepSeek-V2 and -V3 in HuggingFace's format (transformers 4.57 DeepseekV2ForCausalLM, DeepseekV3ForCausalLM):
their config.json fields as ModelConfig fields and back, and their tensor names (hf_format.py loads and saves
them as it does its own families)."""
from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.hf_family import Family
from syntorch.hf_recent import rope_scaling_fields, rope_scaling_hf
from syntorch.hf_values import eps as _eps, require as _require, size as _size

_BLOCK = "model.layers.{i}."
_ATTN, _MLP = _BLOCK + "self_attn.", _BLOCK + "mlp."
_MODULES = {
    "tok_emb": "model.embed_tokens", "ln_f": "model.norm", "lm_head": "lm_head",
    "layers.{i}.ln1": _BLOCK + "input_layernorm", "layers.{i}.ln2": _BLOCK + "post_attention_layernorm",
    "layers.{i}.attn.q_a": _ATTN + "q_a_proj", "layers.{i}.attn.q_norm": _ATTN + "q_a_layernorm",
    "layers.{i}.attn.q_b": _ATTN + "q_b_proj", "layers.{i}.attn.q": _ATTN + "q_proj",
    "layers.{i}.attn.kv_a": _ATTN + "kv_a_proj_with_mqa", "layers.{i}.attn.kv_norm": _ATTN + "kv_a_layernorm",
    "layers.{i}.attn.kv_b": _ATTN + "kv_b_proj", "layers.{i}.attn.proj": _ATTN + "o_proj",
    # the dense layers' MLP, fused [gate; up] as Llama's
    "layers.{i}.mlp.fc1": (_MLP + "gate_proj", _MLP + "up_proj"), "layers.{i}.mlp.fc2": _MLP + "down_proj",
    "layers.{i}.mlp.router": _MLP + "gate",  # its weight, and V3's e_score_correction_bias
    "layers.{i}.mlp.experts.{e}.fc1": (_MLP + "experts.{e}.gate_proj", _MLP + "experts.{e}.up_proj"),
    "layers.{i}.mlp.experts.{e}.fc2": _MLP + "experts.{e}.down_proj",
    "layers.{i}.mlp.shared.fc1": (_MLP + "shared_experts.gate_proj", _MLP + "shared_experts.up_proj"),
    "layers.{i}.mlp.shared.fc2": _MLP + "shared_experts.down_proj"}
# what both classes fix; None: a field config.json chooses (MLA's own fields always are)
_FLAGS = dict(pos="rotary", norm="rmsnorm", activation="silu", gated_mlp=True, mlp_bias=False, parallel_residual=False,
              qkv_bias=False, proj_bias=False, head_bias=False, sliding_window=0, n_kv_head=0, rotary_dim=None,
              n_experts=None, rope_scaling=None, swiglu_limit=0.0)


def _family(model_type: str, architecture: str, ignored: str = "", **flags) -> Family:
    return Family(model_type=model_type, architecture=architecture, body="model.", head="lm_head.",
                  flags={**_FLAGS, **flags}, modules=_MODULES, tied="lm_head.weight",
                  ignored=r"\.rotary_emb\.inv_freq$" + ignored)


DEEPSEEK_V2 = _family("deepseek_v2", "DeepseekV2ForCausalLM", moe_topk_method=None, moe_renormalize=False,
                      yarn_softmax_mscale=False, rotary_style="interleaved")
# HF drops DeepSeek-V3's multi-token-prediction module (layer 61 of the published checkpoint) on load; so do we
DEEPSEEK_V3 = _family("deepseek_v3", "DeepseekV3ForCausalLM", r"|^model\.layers\.61\.", moe_topk_method="noaux_tc",
                      moe_renormalize=None, yarn_softmax_mscale=True, rotary_style=None)
DEEPSEEK = (DEEPSEEK_V2, DEEPSEEK_V3)
_V2_METHODS = ("greedy", "group_limited_greedy")  # what DeepseekV2MoEGate computes


def family_of(c: ModelConfig):
    if not c.n_experts:
        raise UserError(f"model '{c.name}': HF's DeepSeek classes have MoE layers; without n_experts it has no "
                        "HuggingFace equivalent")
    if c.rope_scaling == "llama3":
        raise UserError(f"model '{c.name}': HF's DeepSeek classes have no Llama 3 rotary scaling")
    if c.moe_topk_method not in ("noaux_tc", *_V2_METHODS):
        raise UserError(f"model '{c.name}': moe_topk_method {c.moe_topk_method!r} has no HuggingFace DeepSeek "
                        "equivalent (V2: greedy, group_limited_greedy; V3: noaux_tc)")
    return DEEPSEEK_V3 if c.moe_topk_method == "noaux_tc" else DEEPSEEK_V2


def fields_from_hf(h: dict, fam) -> dict:
    _require(h, "hidden_act", ("silu",), "silu")
    _require(h, "attention_bias", (False,), False)
    _require(h, "mlp_bias", (False,), False)
    nope, rope = _size(h, "qk_nope_head_dim"), _size(h, "qk_rope_head_dim")
    fields = dict(
        d_model=_size(h, "hidden_size"), n_head=_size(h, "num_attention_heads"), n_layer=_size(h, "num_hidden_layers"),
        vocab_size=_size(h, "vocab_size"), n_positions=_size(h, "max_position_embeddings"),
        d_ff=_size(h, "intermediate_size"), d_head=nope + rope, rotary_dim=rope, v_head_dim=_size(h, "v_head_dim"),
        kv_lora_rank=_size(h, "kv_lora_rank"),
        q_lora_rank=_optional(h, "q_lora_rank", 0),
        ln_eps=_eps(h, "rms_norm_eps", 1e-6), rope_theta=_eps(h, "rope_theta", 10000.0),
        tied_head=h.get("tie_word_embeddings", False) is True,
        n_experts=_size(h, "n_routed_experts"), d_ff_expert=_size(h, "moe_intermediate_size"),
        moe_top_k=_size(h, "num_experts_per_tok"), n_shared_experts=_size(h, "n_shared_experts"),
        first_k_dense=_count(h, "first_k_dense_replace"), moe_n_group=_optional(h, "n_group"),
        moe_topk_group=_optional(h, "topk_group"), moe_routed_scale=_eps(h, "routed_scaling_factor", 1.0),
        **{k: v for k, v in fam.flags.items() if v is not None}, **rope_scaling_fields(h, ("yarn",)))
    if fam is DEEPSEEK_V3:  # its class always scores by sigmoid with the correction bias (noaux_tc)
        fields.update(moe_renormalize=h.get("norm_topk_prob", True) is True,
                      rotary_style="interleaved" if h.get("rope_interleave", True) else "half")
    else:
        _require(h, "scoring_func", ("softmax",), "softmax")
        fields["moe_topk_method"] = _require(h, "topk_method", _V2_METHODS, "greedy")
    return fields


def _optional(h: dict, key: str, unset: int = 1) -> int:
    """A size HF lets be null (DeepseekV2Config's n_group and topk_group default to None, for greedy routing)."""
    return unset if h.get(key) is None else _size(h, key)


def _count(h: dict, key: str) -> int:
    value = h.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UserError(f"config.json: {key} must be an integer >= 0, got {value!r}")
    return value


def fields_to_hf(c: ModelConfig, fam) -> dict:
    out = {"hidden_size": c.d_model, "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
           "num_key_value_heads": c.n_head, "intermediate_size": c.d_ff, "hidden_act": "silu",
           "max_position_embeddings": c.n_positions, "rms_norm_eps": c.ln_eps, "rope_theta": c.rope_theta,
           "attention_bias": False, "q_lora_rank": c.q_lora_rank or None, "kv_lora_rank": c.kv_lora_rank,
           "qk_nope_head_dim": c.d_head - c.rotary_dim, "qk_rope_head_dim": c.rotary_dim,
           "v_head_dim": c.value_head_dim, "n_routed_experts": c.n_experts, "moe_intermediate_size": c.expert_d_ff,
           "num_experts_per_tok": c.moe_top_k, "n_shared_experts": c.n_shared_experts,
           "first_k_dense_replace": c.first_k_dense, "n_group": c.moe_n_group, "topk_group": c.moe_topk_group,
           "routed_scaling_factor": c.moe_routed_scale, "norm_topk_prob": c.moe_renormalize,
           "rope_scaling": rope_scaling_hf(c)}
    if fam is DEEPSEEK_V3:
        out.update(rope_interleave=c.rotary_style == "interleaved", topk_method="noaux_tc", scoring_func="sigmoid")
    else:
        out.update(topk_method=c.moe_topk_method, scoring_func="softmax", mlp_bias=False)
    return out
