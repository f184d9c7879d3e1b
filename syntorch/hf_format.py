"""HuggingFace's checkpoint format <-> syntorch's: which families load (one table each, used in both directions),
their config.json fields as ModelConfig fields and back, and their tensor names and layouts as ours and back.
No file I/O: checkpoints.py reads and writes the folders."""
import functools
import re
from collections.abc import Mapping

import torch

from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.hf_deepseek import DEEPSEEK
from syntorch.hf_deepseek import family_of as deepseek_family
from syntorch.hf_deepseek import fields_from_hf as deepseek_fields_from_hf
from syntorch.hf_deepseek import fields_to_hf as deepseek_fields_to_hf
from syntorch.hf_family import Family
from syntorch.hf_recent import (gpt_oss_fields, gpt_oss_hf_fields, qwen3_moe_fields, qwen3_moe_hf_fields,
                                 refuse_quantized, rope_scaling_fields, rope_scaling_hf)
from syntorch.hf_stacked import Stacked, stack_experts
from syntorch.hf_values import eps as _eps, require as _require, size as _size
from syntorch.models import build_model


_GPT_IGNORED = r"\.attn\.(masked_)?bias$"  # causal-mask buffers in older checkpoints
_GPT_BLOCK = "transformer.h.{i}."
# what the GPT-2, GPT-J and BERT classes fix that the Llama layout changes
_CLASSIC = dict(norm="layernorm", gated_mlp=False, mlp_bias=True, n_kv_head=0, sliding_window=0, n_experts=0)
# what Qwen3, GPT-OSS and DeepSeek (MLA aside: hf_deepseek.py) added, which no older class has
_NOT_RECENT = dict(qk_norm=False, attn_sinks=False, router_bias=False, swiglu_limit=0.0, sliding_window_pattern=0,
                   first_k_dense=0, moe_topk_method="", moe_routed_scale=1.0)
_CLASSIC.update(_NOT_RECENT)

GPT2 = Family(
    model_type="gpt2", architecture="GPT2LMHeadModel", body="transformer.", head="lm_head.",
    flags=dict(pos="learned", parallel_residual=False, head_bias=False, qkv_bias=True, proj_bias=True, **_CLASSIC),
    modules={"tok_emb": "transformer.wte", "pos_emb": "transformer.wpe", "ln_f": "transformer.ln_f",
             "lm_head": "lm_head",
             "layers.{i}.ln1": _GPT_BLOCK + "ln_1", "layers.{i}.attn.qkv": _GPT_BLOCK + "attn.c_attn",
             "layers.{i}.attn.proj": _GPT_BLOCK + "attn.c_proj", "layers.{i}.ln2": _GPT_BLOCK + "ln_2",
             "layers.{i}.mlp.fc1": _GPT_BLOCK + "mlp.c_fc", "layers.{i}.mlp.fc2": _GPT_BLOCK + "mlp.c_proj"},
    conv1d=("layers.{i}.attn.qkv", "layers.{i}.attn.proj", "layers.{i}.mlp.fc1", "layers.{i}.mlp.fc2"),
    ignored=_GPT_IGNORED, tied="lm_head.weight")

GPTJ = Family(
    model_type="gptj", architecture="GPTJForCausalLM", body="transformer.", head="lm_head.",
    flags=dict(pos="rotary", parallel_residual=True, head_bias=True, qkv_bias=False, proj_bias=False,
               rotary_style="interleaved", rope_theta=10000.0, rope_scaling="", **_CLASSIC),
    modules={"tok_emb": "transformer.wte", "ln_f": "transformer.ln_f", "lm_head": "lm_head",
             "layers.{i}.ln1": _GPT_BLOCK + "ln_1",
             "layers.{i}.attn.qkv": tuple(f"{_GPT_BLOCK}attn.{x}_proj" for x in "qkv"),
             "layers.{i}.attn.proj": _GPT_BLOCK + "attn.out_proj",
             "layers.{i}.mlp.fc1": _GPT_BLOCK + "mlp.fc_in", "layers.{i}.mlp.fc2": _GPT_BLOCK + "mlp.fc_out"},
    ignored=_GPT_IGNORED, tied="lm_head.weight")

_BERT_BLOCK = "bert.encoder.layer.{i}."
BERT = Family(
    model_type="bert", architecture="BertForMaskedLM", body="bert.", head="cls.",
    flags=dict(pos="learned", parallel_residual=False, head_bias=True, qkv_bias=True, proj_bias=True, **_CLASSIC),
    modules={"tok_emb": "bert.embeddings.word_embeddings", "pos_emb": "bert.embeddings.position_embeddings",
             "type_emb": "bert.embeddings.token_type_embeddings", "ln_emb": "bert.embeddings.LayerNorm",
             "layers.{i}.attn.qkv": tuple(f"{_BERT_BLOCK}attention.self.{x}" for x in ("query", "key", "value")),
             "layers.{i}.attn.proj": _BERT_BLOCK + "attention.output.dense",
             "layers.{i}.ln1": _BERT_BLOCK + "attention.output.LayerNorm",
             "layers.{i}.mlp.fc1": _BERT_BLOCK + "intermediate.dense",
             "layers.{i}.mlp.fc2": _BERT_BLOCK + "output.dense",
             "layers.{i}.ln2": _BERT_BLOCK + "output.LayerNorm",
             "head_dense": "cls.predictions.transform.dense", "head_ln": "cls.predictions.transform.LayerNorm",
             "lm_head": "cls.predictions.decoder"},
    params={"lm_head.bias": "cls.predictions.bias"},  # HF ties decoder.bias to this one and saves only it
    # BertForPreTraining checkpoints (bert-base-uncased) also hold the pooler and the next-sentence head
    ignored=r"embeddings\.position_ids$|^bert\.pooler\.|^cls\.seq_relationship\.|^cls\.predictions\.decoder\.bias$",
    tied="cls.predictions.decoder.weight")

# Llama and the classes that copy its layout: model.layers.{i}.self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj
_LLAMA_BLOCK = "model.layers.{i}."
_LLAMA_FLAGS = dict(pos="rotary", rotary_style="half", rotary_dim=0, norm="rmsnorm", activation="silu", gated_mlp=True,
                    mlp_bias=False, parallel_residual=False, qkv_bias=False, proj_bias=False, head_bias=False,
                    n_experts=0, sliding_window=0, **_NOT_RECENT)
_LLAMA_MODULES = {
    "tok_emb": "model.embed_tokens", "ln_f": "model.norm", "lm_head": "lm_head",
    "layers.{i}.ln1": _LLAMA_BLOCK + "input_layernorm", "layers.{i}.ln2": _LLAMA_BLOCK + "post_attention_layernorm",
    "layers.{i}.attn.qkv": tuple(f"{_LLAMA_BLOCK}self_attn.{x}_proj" for x in "qkv"),
    "layers.{i}.attn.proj": _LLAMA_BLOCK + "self_attn.o_proj",
    "layers.{i}.mlp.fc1": (_LLAMA_BLOCK + "mlp.gate_proj", _LLAMA_BLOCK + "mlp.up_proj"),  # fused [gate; up]
    "layers.{i}.mlp.fc2": _LLAMA_BLOCK + "mlp.down_proj"}
_MOE_BLOCK = _LLAMA_BLOCK + "block_sparse_moe."
_MIXTRAL_MODULES = {
    **{k: v for k, v in _LLAMA_MODULES.items() if ".mlp." not in k},
    "layers.{i}.mlp.router": _MOE_BLOCK + "gate",
    "layers.{i}.mlp.experts.{e}.fc1": (_MOE_BLOCK + "experts.{e}.w1", _MOE_BLOCK + "experts.{e}.w3"),  # [gate; up]
    "layers.{i}.mlp.experts.{e}.fc2": _MOE_BLOCK + "experts.{e}.w2"}
_LLAMA_IGNORED = r"\.rotary_emb\.inv_freq$"  # a buffer older checkpoints saved


def _llama_like(model_type: str, architecture: str, modules=_LLAMA_MODULES, **flags) -> Family:
    return Family(model_type=model_type, architecture=architecture, body="model.", head="lm_head.",
                  flags={**_LLAMA_FLAGS, **flags}, modules=modules, ignored=_LLAMA_IGNORED, tied="lm_head.weight")


# None: a field the class lets config.json choose
LLAMA = _llama_like("llama", "LlamaForCausalLM")
MISTRAL = _llama_like("mistral", "MistralForCausalLM", sliding_window=None)
QWEN2 = _llama_like("qwen2", "Qwen2ForCausalLM", qkv_bias=True)
MIXTRAL = _llama_like("mixtral", "MixtralForCausalLM", _MIXTRAL_MODULES, sliding_window=None, n_experts=None,
                      n_shared_experts=0, moe_renormalize=True)
_QWEN3_MODULES = {**_LLAMA_MODULES, "layers.{i}.attn.q_norm": _LLAMA_BLOCK + "self_attn.q_norm",
                  "layers.{i}.attn.k_norm": _LLAMA_BLOCK + "self_attn.k_norm"}
QWEN3 = _llama_like("qwen3", "Qwen3ForCausalLM", _QWEN3_MODULES, qk_norm=True)
_QWEN3_EXPERT = _LLAMA_BLOCK + "mlp.experts.{e}."
QWEN3_MOE = _llama_like("qwen3_moe", "Qwen3MoeForCausalLM", {
    **{k: v for k, v in _QWEN3_MODULES.items() if ".mlp." not in k}, "layers.{i}.mlp.router": _LLAMA_BLOCK + "mlp.gate",
    "layers.{i}.mlp.experts.{e}.fc1": (_QWEN3_EXPERT + "gate_proj", _QWEN3_EXPERT + "up_proj"),  # [gate; up]
    "layers.{i}.mlp.experts.{e}.fc2": _QWEN3_EXPERT + "down_proj"},
    qk_norm=True, n_experts=None, n_shared_experts=0, moe_renormalize=None)
GPT_OSS = Family(
    model_type="gpt_oss", architecture="GptOssForCausalLM", body="model.", head="lm_head.", ignored=_LLAMA_IGNORED,
    tied="lm_head.weight",
    flags={**_LLAMA_FLAGS, "qkv_bias": True, "proj_bias": True, "mlp_bias": True, "attn_sinks": True,
           "router_bias": True, "swiglu_limit": 7.0,  # HF's GptOssExperts fixes the limit (and alpha 1.702)
           "sliding_window": None, "sliding_window_pattern": None, "n_experts": None, "n_shared_experts": 0,
           "moe_renormalize": True},
    modules={**{k: v for k, v in _LLAMA_MODULES.items() if ".mlp." not in k},
             "layers.{i}.attn.sinks": _LLAMA_BLOCK + "self_attn.sinks", "layers.{i}.mlp.router": _LLAMA_BLOCK + "mlp.router"},
    params={"layers.{i}.attn.sinks.weight": _LLAMA_BLOCK + "self_attn.sinks"},  # a parameter of HF's attention
    stacked={"layers.{i}.mlp.experts.{e}.fc1": _LLAMA_BLOCK + "mlp.experts.gate_up_proj",
             "layers.{i}.mlp.experts.{e}.fc2": _LLAMA_BLOCK + "mlp.experts.down_proj"})
LLAMA_LIKE = (LLAMA, MISTRAL, QWEN2, MIXTRAL, QWEN3, QWEN3_MOE, GPT_OSS)

FAMILIES = (GPT2, GPTJ, BERT, *LLAMA_LIKE)
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


# ---- config.json <-> ModelConfig


def _hf_family(hf_config: dict) -> Family:
    model_type, archs = hf_config.get("model_type"), hf_config.get("architectures") or []
    for fam in (*FAMILIES, *DEEPSEEK):
        if model_type == fam.model_type or (model_type is None and fam.architecture in archs):
            return fam
    known = ", ".join(f"{f.model_type} ({f.architecture})" for f in (*FAMILIES, *DEEPSEEK))
    raise UserError(f"config.json: model_type {model_type!r} (architectures {archs}) is not supported; "
                    f"syntorch loads {known}")


def hf_config_to_model_config(hf_config: dict, name: str = "hf-checkpoint") -> ModelConfig:
    """Our ModelConfig for a HuggingFace config.json; fields our model cannot represent are UserErrors."""
    if not isinstance(hf_config, dict):
        raise UserError("config.json must hold a JSON object")
    fam = _hf_family(hf_config)
    _require(hf_config, "add_cross_attention", (False,), False)
    refuse_quantized(hf_config)
    if fam in LLAMA_LIKE:
        return ModelConfig(name, "gpt", **_llama_fields(hf_config, fam))
    if fam in DEEPSEEK:
        return ModelConfig(name, "gpt", **deepseek_fields_from_hf(hf_config, fam))
    fields = _bert_fields(hf_config) if fam is BERT else _gpt_fields(hf_config, fam)
    if fields["d_model"] % fields["n_head"]:
        raise UserError(f"config.json: hidden size {fields['d_model']} is not divisible by the head count "
                        f"{fields['n_head']}")
    return ModelConfig(name, "bert" if fam is BERT else "gpt", **fields)


def _llama_fields(h: dict, fam: Family) -> dict:
    _require(h, "hidden_act", ("silu",), "silu")
    # Llama's option; Qwen2's q/k/v biases are fixed; GPT-OSS has q/k/v/o biases whatever config.json says
    _require(h, "attention_bias", (False, True) if fam is GPT_OSS else (False,), False)
    _require(h, "mlp_bias", (False,), False)
    _require(h, "use_sliding_window", (False,), False)  # Qwen2 windows only some layers
    d_model, n_head = _size(h, "hidden_size"), _size(h, "num_attention_heads")
    if h.get("head_dim") is None and d_model % n_head:
        raise UserError(f"config.json: hidden size {d_model} is not divisible by the head count {n_head}")
    fields = dict(d_model=d_model, n_head=n_head, n_layer=_size(h, "num_hidden_layers"),
                  vocab_size=_size(h, "vocab_size"), n_positions=_size(h, "max_position_embeddings"),
                  d_ff=_size(h, "intermediate_size"), n_kv_head=_size(h, "num_key_value_heads", n_head),
                  d_head=d_model // n_head if h.get("head_dim") is None else _size(h, "head_dim"),
                  ln_eps=_eps(h, "rms_norm_eps", 1e-6), rope_theta=_eps(h, "rope_theta", 10000.0),
                  tied_head=h.get("tie_word_embeddings", False) is True,
                  **{k: v for k, v in fam.flags.items() if v is not None}, **rope_scaling_fields(h))
    if fam.flags["sliding_window"] is None and h.get("sliding_window") is not None:
        fields["sliding_window"] = _size(h, "sliding_window")
    if fam in (MIXTRAL, GPT_OSS):
        fields.update(n_experts=_size(h, "num_local_experts", 8), moe_top_k=_size(h, "num_experts_per_tok", 2))
    if fam is QWEN3_MOE:
        fields.update(qwen3_moe_fields(h))
    if fam is GPT_OSS:
        fields.update(gpt_oss_fields(h, fields["n_layer"]))
    return fields


def _bert_fields(h: dict) -> dict:
    _require(h, "position_embedding_type", ("absolute",), "absolute")
    _require(h, "is_decoder", (False,), False)
    _require(h, "hidden_act", ("gelu",), "gelu")  # our MLM head applies exact gelu, as BERT's does
    pad = h.get("pad_token_id", 0)  # null in some configs; only our MLM data reads it
    fields = dict(d_model=_size(h, "hidden_size"), n_head=_size(h, "num_attention_heads"),
                  n_layer=_size(h, "num_hidden_layers"), vocab_size=_size(h, "vocab_size"),
                  n_positions=_size(h, "max_position_embeddings"), d_ff=_size(h, "intermediate_size"),
                  activation="gelu", ln_eps=_eps(h, "layer_norm_eps", 1e-12), head_bias=True,
                  type_vocab_size=_size(h, "type_vocab_size", 2), pad_token_id=pad if isinstance(pad, int) else 0,
                  tied_head=h.get("tie_word_embeddings", True) is not False)
    if isinstance(h.get("mask_token_id"), int):  # written by save_checkpoint; HF keeps it in the tokenizer
        fields["mask_token_id"] = h["mask_token_id"]
    return fields


def _gpt_fields(h: dict, fam: Family) -> dict:
    act = _require(h, "activation_function", tuple(_ACTIVATIONS), "gelu_new")
    d_model, n_head = _size(h, "n_embd"), _size(h, "n_head")
    fields = dict(d_model=d_model, n_head=n_head, n_layer=_size(h, "n_layer"), vocab_size=_size(h, "vocab_size"),
                  n_positions=_size(h, "n_positions"), d_ff=0 if h.get("n_inner") is None else _size(h, "n_inner"),
                  activation=_ACTIVATIONS[act], ln_eps=_eps(h, "layer_norm_epsilon", 1e-5))
    if fam is GPT2:
        _require(h, "scale_attn_weights", (True,), True)
        _require(h, "scale_attn_by_inverse_layer_idx", (False,), False)
        return {**fields, "tied_head": h.get("tie_word_embeddings", True) is not False}
    # GPT-J: rotary over rotary_dim dims of each head (all of them when null), untied head by default
    rotary_dim = d_model // n_head if h.get("rotary_dim") is None else _size(h, "rotary_dim")
    return {**fields, **fam.flags, "rotary_dim": rotary_dim, "tied_head": h.get("tie_word_embeddings", False) is True}


def model_config_to_hf_config(c: ModelConfig) -> dict:
    """The config.json that makes `transformers` build the same model; UserError if no HF class can."""
    fam = _family(c)
    common = {"architectures": [fam.architecture], "model_type": fam.model_type, "vocab_size": c.vocab_size,
              "tie_word_embeddings": c.tied_head}
    if fam in LLAMA_LIKE:
        return {**common, **_llama_hf_fields(c, fam)}
    if fam in DEEPSEEK:
        return {**common, **deepseek_fields_to_hf(c, fam)}
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu"}[c.activation]
    if fam is BERT:
        return {**common, "hidden_size": c.d_model, "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
                "intermediate_size": c.d_ff, "hidden_act": act, "max_position_embeddings": c.n_positions,
                "type_vocab_size": c.type_vocab_size, "layer_norm_eps": c.ln_eps, "pad_token_id": c.pad_token_id,
                "mask_token_id": c.mask_token_id, "position_embedding_type": "absolute"}
    gpt = {**common, "n_embd": c.d_model, "n_layer": c.n_layer, "n_head": c.n_head, "n_inner": c.d_ff,
           "n_positions": c.n_positions, "activation_function": act, "layer_norm_epsilon": c.ln_eps}
    return {**gpt, "rotary_dim": c.rotary_dim} if fam is GPTJ else gpt


def _llama_hf_fields(c: ModelConfig, fam: Family) -> dict:
    out = {"hidden_size": c.d_model, "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
           "num_key_value_heads": c.kv_heads, "head_dim": c.d_head, "intermediate_size": c.d_ff, "hidden_act": "silu",
           "max_position_embeddings": c.n_positions, "rms_norm_eps": c.ln_eps, "rope_theta": c.rope_theta,
           "rope_scaling": rope_scaling_hf(c), "attention_bias": False, "mlp_bias": False, "use_sliding_window": False}
    if fam.flags["sliding_window"] is None:
        out["sliding_window"] = c.sliding_window or None
    if fam is MIXTRAL:
        out.update(num_local_experts=c.n_experts, num_experts_per_tok=c.moe_top_k, router_jitter_noise=0.0)
    if fam is QWEN3_MOE:
        out.update(qwen3_moe_hf_fields(c))
    if fam is GPT_OSS:
        out.update(gpt_oss_hf_fields(c))
    return out


def _family(c: ModelConfig) -> Family:
    """The HF class that holds this config: chosen by its layout, then every field that class fixes checked."""
    if c.arch == "bert":
        fam = BERT
    elif c.mla:
        fam = deepseek_family(c)
    elif c.pos == "learned" or c.rotary_style == "interleaved":
        fam = GPT2 if c.pos == "learned" else GPTJ
    elif c.attn_sinks or c.qk_norm:
        fam = GPT_OSS if c.attn_sinks else QWEN3_MOE if c.n_experts else QWEN3
    else:
        fam = MIXTRAL if c.n_experts else QWEN2 if c.qkv_bias else MISTRAL if c.sliding_window else LLAMA
    for key, want in fam.flags.items():
        if want is not None and getattr(c, key) != want:
            raise UserError(f"model '{c.name}': {key}={getattr(c, key)!r} has no HuggingFace {fam.architecture} "
                            f"equivalent (it needs {want!r}); cannot save it in HF format")
    if fam not in LLAMA_LIKE and not c.mla and c.d_head * c.n_head != c.d_model:
        raise UserError(f"model '{c.name}': d_head {c.d_head} x n_head {c.n_head} != d_model {c.d_model}; "
                        "HuggingFace models need d_model = n_head x d_head")
    if fam is BERT and c.activation != "gelu":
        raise UserError(f"model '{c.name}': activation {c.activation!r}; BERT in HF format needs 'gelu'")
    return fam


# ---- state dicts


def _key_map(keys, c: ModelConfig, fam: Family) -> dict:
    """Our parameter name -> (HF name or (q, k, v) names, is_conv1d_weight), for our state-dict keys."""
    out = {}
    for key in keys:
        module, param = key.rsplit(".", 1)
        # block i and expert e: layers.3.mlp.experts.5.fc1 -> layers.{i}.mlp.experts.{e}.fc1
        index = dict(zip("ie", (m.group(1) if m else None for m in (re.match(r"layers\.(\d+)\.", module),
                                                                     re.search(r"\.experts\.(\d+)\.", module)))))
        template = re.sub(r"\.experts\.\d+\.", ".experts.{e}.", re.sub(r"^layers\.\d+\.", "layers.{i}.", module))
        if template in fam.stacked:  # GPT-OSS's experts: one HF tensor per layer (hf_stacked.py)
            name = fam.stacked[template].format(**index) + ("_bias" if param == "bias" else "")
            out[key] = (Stacked(name, int(index["e"]), c.n_experts, template.endswith(".fc1")), False)
            continue
        hf = fam.modules[template]
        names = tuple(f"{s.format(**index)}.{param}" for s in (hf if isinstance(hf, tuple) else (hf,)))
        source = names if isinstance(hf, tuple) else names[0]
        renamed = fam.params.get(f"{template}.{param}")  # a parameter HF keeps elsewhere, in block i
        out[key] = (renamed.format(**index) if renamed else source, template in fam.conv1d and param == "weight")
    if c.tied_head:
        out["lm_head.weight"] = out["tok_emb.weight"]
    return out


def _canonical(key: str, fam: Family) -> str:
    """HF key as the LM model names it: body prefix added when a base model was saved, LayerNorm gamma/beta renamed."""
    if not key.startswith((fam.body, fam.head)):
        key = fam.body + key
    return re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key))


def source_names(source) -> tuple:
    """The HF tensor names one of our tensors is read from."""
    return (source.name,) if isinstance(source, Stacked) else (source,) if isinstance(source, str) else source


def few_names(names) -> str:
    names = sorted(names)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def checked_key_map(hf_names, config: ModelConfig) -> tuple[dict, dict, dict]:
    """(our name -> (source, is_conv1d), canonical HF name -> stored name, our expected meta state dict), once
    the HF names are checked to hold exactly this config's model."""
    fam = _family(config)
    hf_keys = {_canonical(k, fam): k for k in hf_names}
    expected = build_model(config, device="meta").state_dict()
    key_map = _key_map(expected, config, fam)
    wanted = {s for source, _ in key_map.values() for s in source_names(source)}
    missing = wanted - set(hf_keys)
    if missing:
        raise UserError(f"checkpoint lacks tensor(s) {few_names(missing)}; it does not hold a complete {fam.architecture}")
    ignored = {k for k in hf_keys if re.search(fam.ignored, k) or (config.tied_head and k == fam.tied)}
    extra = set(hf_keys) - wanted - ignored
    if extra:
        raise UserError(f"checkpoint has tensor(s) {few_names(hf_keys[k] for k in extra)} that {fam.architecture} does not; "
                        "is config.json the one saved with these weights?")
    return key_map, hf_keys, expected


def hf_to_syntorch_state_dict(hf_state_dict: Mapping, config: ModelConfig) -> dict:
    """Our state dict (full, unsharded) from a HuggingFace one. Reads each HF tensor once, so a lazy mapping
    (one file read per access) keeps at most one converted tensor beyond the result in memory (GPT-OSS: a layer's
    four stacked expert tensors, while their experts are cut from them)."""
    key_map, hf_keys, expected = checked_key_map(hf_state_dict, config)
    # a layer's stacked experts are read in turn (fc1 weight, bias, fc2 weight, bias per expert): keep those four
    stacked = functools.lru_cache(maxsize=4)(lambda name: hf_state_dict[hf_keys[name]])
    out, done = {}, {}
    for key, (source, conv1d) in key_map.items():
        if source not in done:
            if isinstance(source, Stacked):
                t = source.read(stacked(source.name))
            else:
                t = (torch.cat([hf_state_dict[hf_keys[s]] for s in source]) if isinstance(source, tuple)
                     else hf_state_dict[hf_keys[source]])
            done[source] = t.t().contiguous() if conv1d else t
        out[key] = done[source]
        check_shape(source, tuple(out[key].shape), expected[key])
    return out


def _unfuse(t: torch.Tensor, c: ModelConfig, parts: int) -> tuple:
    """One of our fused tensors as the HF tensors it holds: q, k, v (K/V may have fewer heads), or gate and up."""
    if parts == 2:
        return t.chunk(2)
    return t.split([c.n_head * c.d_head, c.kv_heads * c.d_head, c.kv_heads * c.d_head])
def check_shape(source, shape: tuple, expected: torch.Tensor) -> None:
    if shape != tuple(expected.shape):
        raise UserError(f"checkpoint tensor {source} has shape {list(shape)} but config.json implies "
                        f"{list(expected.shape)}; the weights do not belong to this config.json")


def syntorch_to_hf_state_dict(model) -> dict:
    """HF-named, contiguous CPU tensors of `model`; a tied head is left out, as transformers saves it."""
    c = model.config
    fam = _family(c)
    state = model.state_dict()
    out, experts = {}, {}
    for key, (source, conv1d) in _key_map(state, c, fam).items():
        if c.tied_head and key == "lm_head.weight":
            continue
        t = state[key].detach().cpu()
        if isinstance(source, Stacked):
            experts.setdefault(source.name, {})[source.expert] = source.write(t)
            continue
        parts = (zip(source, _unfuse(t, c, len(source))) if isinstance(source, tuple)
                 else [(source, t.t() if conv1d else t)])
        out.update({name: part.contiguous() for name, part in parts})
    return {**out, **stack_experts(experts)}
