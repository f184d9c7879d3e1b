"""config.json <-> ModelConfig for what Qwen3-MoE and GPT-OSS add to the Llama layout (their experts, GPT-OSS's layer
types and clamp), rotary scaling (Llama 3.1's, YaRN's) for every family that has it, and the refusal of quantized
folders. hf_format.py and hf_deepseek.py call these; the tensor names are their tables."""
from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.hf_values import eps, require, size


def refuse_quantized(h: dict) -> None:
    quantized = h.get("quantization_config")
    # GPT-OSS ships MXFP4 experts (*_blocks, *_scales), DeepSeek-V3 FP8 weights with block scales
    if quantized is not None:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
        raise UserError(f"config.json: quantization_config {method!r} weights are not supported: syntorch loads "
                        "unquantized weights only; dequantize first (MXFP4: transformers' "
                        "Mxfp4Config(dequantize=True), then save_pretrained; DeepSeek's FP8: its fp8_cast_bf16.py)")


def qwen3_moe_fields(h: dict) -> dict:
    require(h, "decoder_sparse_step", (1,), 1)  # every published Qwen3-MoE has every layer sparse
    if h.get("mlp_only_layers"):
        raise UserError(f"config.json: mlp_only_layers={h['mlp_only_layers']!r} is not supported (every layer sparse)")
    return dict(n_experts=size(h, "num_experts"), moe_top_k=size(h, "num_experts_per_tok"),
                d_ff_expert=size(h, "moe_intermediate_size"), moe_renormalize=h.get("norm_topk_prob", False) is True)


def gpt_oss_fields(h: dict, n_layer: int) -> dict:
    require(h, "swiglu_limit", (7.0, 7), 7.0)  # what HF's GptOssExperts applies, whatever config.json says
    return dict(sliding_window_pattern=_window_pattern(h, n_layer))


def _window_pattern(h: dict, n_layer: int) -> int:
    """GPT-OSS's layer_types as our sliding_window_pattern: every p-th layer full attention, the rest windowed."""
    types = h.get("layer_types") or [layer_type(2, i) for i in range(n_layer)]  # HF's default alternates
    for p in range(n_layer + 1):
        if types == [layer_type(p, i) for i in range(n_layer)]:
            return p
    raise UserError(f"config.json: layer_types {types!r} is not every p-th layer full attention and the rest "
                    "sliding_attention, which is what syntorch supports")


def layer_type(pattern: int, layer: int) -> str:
    return "full_attention" if pattern and (layer + 1) % pattern == 0 else "sliding_attention"


def rope_scaling_fields(h: dict, kinds: tuple = ("llama3", "yarn")) -> dict:
    """config.json's rope_scaling as our fields: none ("default"), or one of the `kinds` the HF class computes."""
    scaling = h.get("rope_scaling")
    if scaling is None:
        return {}
    if not isinstance(scaling, dict):
        raise UserError(f"config.json: rope_scaling must be a JSON object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))  # DeepSeek's configs say "type"
    if kind == "default":
        return {}
    if kind not in kinds:
        raise UserError(f"config.json: rope_scaling type {kind!r} is not supported (supported: "
                        f"{', '.join(map(repr, (*kinds, 'default')))})")
    if kind == "yarn":
        return _yarn_fields(scaling, h)
    return dict(rope_scaling="llama3", rope_factor=eps(scaling, "factor"),
                rope_low_freq_factor=eps(scaling, "low_freq_factor"),
                rope_high_freq_factor=eps(scaling, "high_freq_factor"),
                rope_original_positions=size(scaling, "original_max_position_embeddings"))


def _yarn_fields(scaling: dict, h: dict) -> dict:
    """What _compute_yarn_parameters reads, with its defaults where a key is absent or null."""
    def number(key, default=0.0):  # 0: unset, as HF's None
        return default if scaling.get(key) is None else eps(scaling, key)

    key = "original_max_position_embeddings"  # HF falls back to max_position_embeddings when it is absent or null
    original = size(scaling, key) if scaling.get(key) is not None else size(h, "max_position_embeddings")
    return dict(rope_scaling="yarn", rope_factor=eps(scaling, "factor"), rope_original_positions=original,
                rope_beta_fast=number("beta_fast", 32.0), rope_beta_slow=number("beta_slow", 1.0),
                rope_truncate=require(scaling, "truncate", (True, False), True),
                rope_attention_factor=number("attention_factor"), rope_mscale=number("mscale"),
                rope_mscale_all_dim=number("mscale_all_dim"))


def rope_scaling_hf(c: ModelConfig) -> dict | None:
    """config.json's rope_scaling for our fields (the optional YaRN keys only when set)."""
    if c.rope_scaling == "llama3":
        return {"rope_type": "llama3", "factor": c.rope_factor, "low_freq_factor": c.rope_low_freq_factor,
                "high_freq_factor": c.rope_high_freq_factor,
                "original_max_position_embeddings": c.rope_original_positions}
    if c.rope_scaling != "yarn":
        return None
    optional = {"attention_factor": c.rope_attention_factor, "mscale": c.rope_mscale,
                "mscale_all_dim": c.rope_mscale_all_dim}
    return {"rope_type": "yarn", "factor": c.rope_factor, "beta_fast": c.rope_beta_fast, "beta_slow": c.rope_beta_slow,
            "truncate": c.rope_truncate, "original_max_position_embeddings": c.rope_original_positions,
            **{k: v for k, v in optional.items() if v}}


def qwen3_moe_hf_fields(c: ModelConfig) -> dict:
    return dict(num_experts=c.n_experts, num_experts_per_tok=c.moe_top_k, moe_intermediate_size=c.expert_d_ff,
                norm_topk_prob=c.moe_renormalize, decoder_sparse_step=1, mlp_only_layers=[])


def gpt_oss_hf_fields(c: ModelConfig) -> dict:
    return dict(num_local_experts=c.n_experts, num_experts_per_tok=c.moe_top_k, attention_bias=True,
                swiglu_limit=c.swiglu_limit, sliding_window=c.sliding_window or None,
                layer_types=[layer_type(c.sliding_window_pattern, i) if c.sliding_window else "full_attention"
                             for i in range(c.n_layer)])
