"""config.json <-> ModelConfig for what Qwen3-MoE and GPT-OSS add to the Llama layout (their experts, GPT-OSS's layer
types and clamp), YaRN rotary scaling, and the refusal of quantized folders. hf_format.py calls these for the
families it names; the tensor names are its tables."""
from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.hf_values import eps, require, size


def refuse_quantized(h: dict) -> None:
    quantized = h.get("quantization_config")
    if quantized is not None:  # GPT-OSS ships MXFP4 experts (*_blocks, *_scales)
        method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
        raise UserError(f"config.json: quantization_config {method!r}: syntorch loads unquantized weights only; "
                        "dequantize first (transformers: Mxfp4Config(dequantize=True), then save_pretrained)")


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


def yarn_fields(scaling: dict) -> dict:
    for key in ("mscale", "mscale_all_dim"):  # DeepSeek's variant of the attention factor
        require(scaling, key, (None, 0), None)
    fields = dict(rope_scaling="yarn", rope_factor=eps(scaling, "factor"),
                  rope_original_positions=size(scaling, "original_max_position_embeddings"),
                  rope_beta_fast=eps(scaling, "beta_fast", 32.0), rope_beta_slow=eps(scaling, "beta_slow", 1.0),
                  rope_truncate=require(scaling, "truncate", (True, False), True))
    if scaling.get("attention_factor") is not None:
        fields["rope_attention_factor"] = eps(scaling, "attention_factor")
    return fields


def yarn_hf_fields(c: ModelConfig) -> dict:
    return {"rope_type": "yarn", "factor": c.rope_factor, "beta_fast": c.rope_beta_fast, "beta_slow": c.rope_beta_slow,
            "truncate": c.rope_truncate, "original_max_position_embeddings": c.rope_original_positions,
            "attention_factor": c.rope_attention_factor or None}


def qwen3_moe_hf_fields(c: ModelConfig) -> dict:
    return dict(num_experts=c.n_experts, num_experts_per_tok=c.moe_top_k, moe_intermediate_size=c.expert_d_ff,
                norm_topk_prob=c.moe_renormalize, decoder_sparse_step=1, mlp_only_layers=[])


def gpt_oss_hf_fields(c: ModelConfig) -> dict:
    return dict(num_local_experts=c.n_experts, num_experts_per_tok=c.moe_top_k, attention_bias=True,
                swiglu_limit=c.swiglu_limit, sliding_window=c.sliding_window or None,
                layer_types=[layer_type(c.sliding_window_pattern, i) if c.sliding_window else "full_attention"
                             for i in range(c.n_layer)])
