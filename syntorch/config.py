"""ModelConfig and the registry of named models (--model, --model_config)."""
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from syntorch.errors import UserError
from syntorch.userfiles import read_json

ACTIVATIONS = ("gelu_tanh", "gelu", "silu")  # what models.layers.MLP applies (silu: SwiGLU with gated_mlp)
# --dtype names -> torch dtype attribute names (strings: this module does not import torch)
# fp8: the model in bf16 with its Linear GEMMs in FP8 (parallel/fp8.py), as Transformer Engine trains
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "bfloat16"}


def from_args(cls, args, **overrides):
    """A config dataclass from parsed options: each field from the option of the same name (argparse's
    dest), `overrides` for those spelled otherwise. Checks are the dataclass's own (__post_init__)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **overrides})


def torch_dtype(name: str):
    """The torch dtype of a --dtype name; one line naming the choices otherwise."""
    if name not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    import torch  # only callers that build tensors need torch
    return getattr(torch, DTYPES[name])


@dataclass
class ModelConfig:
    name: str
    arch: str  # "gpt" (decoder-only, causal LM) | "bert" (encoder + MLM head)
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    n_positions: int  # context length
    d_head: int = 0  # 0: d_model // n_head
    d_ff: int = 0  # 0: 4 * d_model, as in GPT-2/GPT-3/BERT
    n_kv_head: int = 0  # grouped-query attention (Ainslie et al. 2023): K/V heads, each shared by n_head / n_kv_head
    # query heads; 0: n_head (multi-head attention)
    pos: str = "learned"  # "learned" (GPT-2/3, BERT) | "rotary" (GPT-J, Llama)
    rotary_dim: int = 0  # rotary applies to the first rotary_dim dims of each head (GPT-J: 64); 0: all of them
    rotary_style: str = "interleaved"  # pairs (x0, x1), (x2, x3).. (GPT-J) | "half": pairs (x_i, x_{i+r/2}) (Llama, NeoX)
    rope_theta: float = 10000.0  # rotary base (Llama 3: 500000, Mixtral and Qwen2: 1e6)
    # Llama 3.1's frequency scaling (HF rope_type "llama3"): long wavelengths slowed by rope_factor, short ones kept,
    # those between blended; rope_original_positions is the context the model was pre-trained at. "": none
    rope_scaling: str = ""
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_positions: int = 8192
    sliding_window: int = 0  # Mistral: each query sees the last sliding_window positions (itself included); 0: all
    # every sliding_window_pattern-th layer (1-based) attends to all positions, the others to the window (HF Gemma's
    # field; GPT-OSS alternates: 2); 0: the window in every layer
    sliding_window_pattern: int = 0
    # YaRN (Peng et al. 2023; HF rope_type "yarn", with rope_factor and rope_original_positions): dims turning more than
    # beta_fast times over the original context kept, fewer than beta_slow times slowed by rope_factor, a ramp between
    # (its ends rounded outwards unless rope_truncate is false); cos and sin scaled by rope_attention_factor
    # (0: HF infers it, models/yarn.py: from rope_mscale / rope_mscale_all_dim when both are set, as DeepSeek's are,
    # else 0.1 ln(rope_factor) + 1, the paper's)
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float = 0.0
    rope_mscale: float = 0.0  # 0: unset (HF's None)
    rope_mscale_all_dim: float = 0.0
    # MLA's softmax scale times yarn_mscale(rope_factor, rope_mscale_all_dim)^2, as DeepSeek's code and HF's
    # DeepseekV3Attention compute it (HF's DeepseekV2Attention leaves it out)
    yarn_softmax_mscale: bool = True
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's d_head dims of q and of k, before rotary
    attn_sinks: bool = False  # GPT-OSS: a learned logit per query head that joins each softmax's denominator
    norm: str = "layernorm"  # "layernorm" (GPT, BERT) | "rmsnorm" (Llama, Mistral, Qwen2, Mixtral)
    parallel_residual: bool = False  # GPT-J: attn and MLP read one LayerNorm, added together
    tied_head: bool = True  # LM head shares the token embedding (GPT-2/3, BERT)
    head_bias: bool = False  # GPT-J's untied head has a bias
    qkv_bias: bool = True  # GPT-J projections have no bias
    proj_bias: bool = True  # attention output projection (GPT-J has none)
    activation: str = "gelu_tanh"  # GPT-2/3/J use the tanh approximation; BERT the exact erf; Llama "silu"
    # SwiGLU (Shazeer 2020; Llama, Mistral, Qwen2, every Mixtral expert): fc1 holds [gate; up], fc2(act(gate x) * up x)
    gated_mlp: bool = False
    mlp_bias: bool = True  # GPT/BERT MLPs have biases; Llama's have none
    # mixture of experts (Mixtral; DeepSeek-style with shared experts): 0 experts is a dense MLP
    n_experts: int = 0  # routed experts per MoE layer (Mixtral: 8)
    moe_top_k: int = 2  # experts each token is routed to (Mixtral: 2; HF num_experts_per_tok)
    d_ff_expert: int = 0  # each routed expert's hidden size; 0: d_ff (Mixtral's experts are full-size MLPs)
    n_shared_experts: int = 0  # DeepSeekMoE: experts every token passes through, unweighted (one MLP of n x d_ff_expert)
    moe_renormalize: bool = True  # Mixtral renormalizes the top-k softmax weights to sum to 1; DeepSeek-V2 does not
    router_bias: bool = False  # GPT-OSS's router Linear has a bias
    # GPT-OSS's clamped SwiGLU: gate clamped above at swiglu_limit, up within +-swiglu_limit, gate * sigmoid(1.702 gate)
    # * (up + 1); 0: plain SwiGLU
    swiglu_limit: float = 0.0
    # DeepSeek-V2/V3 (DeepSeek-AI 2024, arXiv 2405.04434 and 2412.19437), all off by default.
    # Multi-head Latent Attention: K/V compressed to kv_lora_rank (the cache holds it) plus one rotary key of
    # rotary_dim dims shared by all heads; d_head is the query/key head size (qk_nope + qk_rope), v_head_dim the value's
    kv_lora_rank: int = 0  # 0: no MLA
    q_lora_rank: int = 0  # MLA's query down-projection rank; 0: a full-rank query projection (DeepSeek-V2-Lite)
    v_head_dim: int = 0  # MLA's value head size; 0: d_head
    first_k_dense: int = 0  # the first k layers have a dense MLP of d_ff, the rest MoE (HF first_k_dense_replace)
    # "": softmax top-k (Mixtral). DeepSeek's (config.json topk_method): "greedy" and "group_limited_greedy" (V2:
    # softmax, groups ranked by their best expert), "noaux_tc" (V3: sigmoid, top-k by score + a correction bias,
    # groups ranked by the sum of their top-2); groups: moe_n_group of them, tokens go to moe_topk_group
    moe_topk_method: str = ""
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_routed_scale: float = 1.0  # routed experts' weights times this (HF routed_scaling_factor)
    ln_eps: float = 1e-5
    type_vocab_size: int = 2  # BERT segment embeddings
    pad_token_id: int = 0
    mask_token_id: int = 103  # BERT [MASK]; used by MLM data

    def __post_init__(self):
        self.d_head = self.d_head or self.d_model // self.n_head
        self.d_ff = self.d_ff or 4 * self.d_model
        check_config(self)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def rotary_dims(self) -> int:
        """Dims of each head that rotary rotates (0 with learned positions)."""
        return (self.rotary_dim or self.d_head) if self.pos == "rotary" else 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def uniform_layers(self) -> bool:
        """Every layer runs the same ops on the same shapes (not so with DeepSeek's dense first layers)."""
        return not (self.n_experts and 0 < self.first_k_dense < self.n_layer)

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim or self.d_head

    @property
    def expert_d_ff(self) -> int:
        return self.d_ff_expert or self.d_ff

    def layer_window(self, layer: int) -> int:
        """The sliding window of block `layer` (0-based); 0: it attends to every earlier position."""
        if self.sliding_window_pattern and (layer + 1) % self.sliding_window_pattern == 0:
            return 0
        return self.sliding_window

    @property
    def causal(self) -> bool:
        return self.arch == "gpt"

    @property
    def encoder(self) -> bool:
        """Predicts masked tokens in one pass (BERT) instead of generating."""
        return self.arch == "bert"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


MAX_ELEMENTS = 2**60  # a tensor's bytes must fit int64 (8-byte elements): torch's storage size limit


def check_config(c: ModelConfig) -> None:
    def need(ok, what):
        if not ok:
            raise UserError(f"model config '{c.name}': {what}")

    need(c.arch in ("gpt", "bert"), f"arch must be 'gpt' or 'bert', got {c.arch!r}")
    widest = max(c.vocab_size, c.d_ff, c.n_head * c.d_head, c.expert_d_ff) * c.d_model
    need(widest < MAX_ELEMENTS, f"a weight of {widest:.3g} elements is past what any device can index "
                                f"({MAX_ELEMENTS:.3g}); check d_model, d_ff, n_head and vocab_size")
    need(c.pos in ("learned", "rotary"), f"pos must be 'learned' or 'rotary', got {c.pos!r}")
    need(c.rotary_style in ("interleaved", "half"), f"rotary_style must be 'interleaved' or 'half', got {c.rotary_style!r}")
    need(c.rope_scaling in ("", "llama3", "yarn"),
         f"rope_scaling must be '', 'llama3' or 'yarn', got {c.rope_scaling!r}")
    need(c.norm in ("layernorm", "rmsnorm"), f"norm must be 'layernorm' or 'rmsnorm', got {c.norm!r}")
    need(c.activation in ACTIVATIONS, f"activation must be one of {', '.join(ACTIVATIONS)}, got {c.activation!r}")
    for k in ("n_layer", "d_model", "n_head", "vocab_size", "n_positions", "d_head", "d_ff"):
        need(isinstance(getattr(c, k), int) and getattr(c, k) > 0, f"{k} must be a positive integer, got {getattr(c, k)!r}")
    for k in ("n_experts", "d_ff_expert", "n_shared_experts"):
        need(isinstance(getattr(c, k), int) and getattr(c, k) >= 0, f"{k} must be an integer >= 0, got {getattr(c, k)!r}")
    need(not c.n_experts or 1 <= c.moe_top_k <= c.n_experts,
         f"moe_top_k must be between 1 and n_experts ({c.n_experts}), got {c.moe_top_k}")
    need(c.arch == "gpt" or not c.n_experts, "bert has no mixture-of-experts layers")
    for k in ("n_kv_head", "sliding_window", "rotary_dim", "sliding_window_pattern"):
        need(isinstance(getattr(c, k), int) and getattr(c, k) >= 0, f"{k} must be an integer >= 0, got {getattr(c, k)!r}")
    need(c.n_head % c.kv_heads == 0,
         f"n_kv_head ({c.n_kv_head}) must divide n_head ({c.n_head}): each K/V head serves a whole group of query heads")
    need(c.rotary_dims <= c.d_head and c.rotary_dims % 2 == 0,
         f"rotary_dim must be even and at most d_head={c.d_head}, got {c.rotary_dim}")
    for k in ("rope_theta", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
        need(isinstance(getattr(c, k), (int, float)) and math.isfinite(getattr(c, k)) and getattr(c, k) > 0,
             f"{k} must be a positive finite number, got {getattr(c, k)!r}")
    need(c.rope_high_freq_factor > c.rope_low_freq_factor,
         f"rope_high_freq_factor ({c.rope_high_freq_factor}) must exceed rope_low_freq_factor ({c.rope_low_freq_factor})")
    need(isinstance(c.rope_original_positions, int) and c.rope_original_positions > 0,
         f"rope_original_positions must be a positive integer, got {c.rope_original_positions!r}")
    need(c.arch == "gpt" or (c.norm, c.kv_heads, c.sliding_window, c.gated_mlp) == ("layernorm", c.n_head, 0, False),
         "bert supports only its own layout (layernorm, multi-head attention, no sliding window, GELU MLP)")
    need(c.arch == "gpt" or c.pos == "learned", "bert uses learned positions")
    _check_recent(c, need)
    check_deepseek(c, need)
    need(isinstance(c.ln_eps, (int, float)) and math.isfinite(c.ln_eps) and c.ln_eps > 0,
         f"ln_eps must be a positive finite number, got {c.ln_eps!r}")


def _check_recent(c: ModelConfig, need) -> None:
    # the numbers Qwen3, GPT-OSS and DeepSeek added, and what Qwen3 and GPT-OSS added to attention
    for k in ("rope_beta_fast", "rope_beta_slow", "rope_attention_factor", "rope_mscale", "rope_mscale_all_dim",
              "swiglu_limit", "moe_routed_scale"):
        v = getattr(c, k)
        need(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0, f"{k} must be a finite number >= 0, got {v!r}")
    need(c.rope_beta_fast > c.rope_beta_slow,
         f"rope_beta_fast ({c.rope_beta_fast}) must exceed rope_beta_slow ({c.rope_beta_slow})")
    need(not c.swiglu_limit or (c.gated_mlp and c.activation == "silu"),
         "swiglu_limit clamps a SwiGLU MLP: it needs gated_mlp true and activation 'silu'")
    need(c.arch == "gpt" or not (c.qk_norm or c.attn_sinks or c.sliding_window_pattern),
         "bert has no q/k norms, attention sinks or per-layer windows")
    need(not c.mla or not (c.qk_norm or c.attn_sinks or c.sliding_window_pattern),
         "MLA (kv_lora_rank > 0) has no q/k norms, attention sinks or per-layer windows")


def check_deepseek(c: ModelConfig, need) -> None:
    """The MLA and DeepSeek routing fields (see ModelConfig)."""
    for k in ("kv_lora_rank", "q_lora_rank", "v_head_dim", "first_k_dense"):
        need(isinstance(getattr(c, k), int) and getattr(c, k) >= 0,
             f"{k} must be an integer >= 0, got {getattr(c, k)!r}")
    need(not c.mla or (c.arch == "gpt" and c.pos == "rotary" and 0 < c.rotary_dim < c.d_head),
         "MLA (kv_lora_rank > 0) needs pos 'rotary' and a rotary_dim (the shared rotary key) below d_head")
    need(c.mla or not (c.q_lora_rank or c.v_head_dim), "q_lora_rank and v_head_dim describe MLA: set kv_lora_rank too")
    need(c.moe_topk_method in ("", "greedy", "group_limited_greedy", "noaux_tc"),
         f"moe_topk_method must be '', 'greedy', 'group_limited_greedy' or 'noaux_tc', got {c.moe_topk_method!r}")
    for k in ("moe_n_group", "moe_topk_group"):
        need(isinstance(getattr(c, k), int) and getattr(c, k) > 0,
             f"{k} must be a positive integer, got {getattr(c, k)!r}")
    need(not c.n_experts or (c.n_experts % c.moe_n_group == 0 and c.moe_topk_group <= c.moe_n_group),
         f"moe_n_group ({c.moe_n_group}) must divide n_experts ({c.n_experts}) and moe_topk_group "
         f"({c.moe_topk_group}) be at most moe_n_group")
    need(c.moe_topk_method != "noaux_tc" or c.n_experts // c.moe_n_group >= 2,
         "noaux_tc ranks groups by their top-2 experts: each group needs at least 2")
    need(not c.n_experts or c.moe_top_k <= c.moe_topk_group * (c.n_experts // c.moe_n_group),
         f"moe_top_k ({c.moe_top_k}) exceeds the experts of moe_topk_group groups")
    need(not (c.moe_topk_method and c.router_bias),
         "DeepSeek's routers (moe_topk_method) have no bias: router_bias false")


def _gpt3(name, n_layer, d_model, n_head):
    # Brown et al. 2020, Table 2.1: dense attention, context 2048, GPT-2 tokenizer.
    return ModelConfig(name, "gpt", n_layer, d_model, n_head, vocab_size=50257, n_positions=2048)


def _gpt2(name, n_layer, d_model, n_head):
    return ModelConfig(name, "gpt", n_layer, d_model, n_head, vocab_size=50257, n_positions=1024)


def _bert(name, n_layer, d_model, n_head):
    return ModelConfig(name, "bert", n_layer, d_model, n_head, vocab_size=30522, n_positions=512,
                       activation="gelu", ln_eps=1e-12, head_bias=True)


def _llama(name, n_layer, d_model, n_head, n_kv_head, d_ff, vocab_size, n_positions, **fields):
    # the Llama layout (Touvron et al. 2023) Mistral, Qwen2 and Mixtral share: pre-RMSNorm, rotary on whole heads
    # in rotate-half form, SwiGLU, no biases, untied head
    layout = dict(pos="rotary", rotary_style="half", norm="rmsnorm", activation="silu", gated_mlp=True,
                  mlp_bias=False, qkv_bias=False, proj_bias=False, tied_head=False)
    return ModelConfig(name, "gpt", n_layer, d_model, n_head, vocab_size, n_positions, d_ff=d_ff, n_kv_head=n_kv_head,
                       **{**layout, **fields})


_LLAMA3_SCALING = dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                       rope_original_positions=8192)

# shapes from each model's HuggingFace config.json (hidden_size, num_hidden_layers, num_attention_heads,
# num_key_value_heads, intermediate_size, vocab_size, max_position_embeddings, rope_theta, rms_norm_eps, ...)
LLAMA_FAMILY = [
    # meta-llama/Llama-2-{7b,13b,70b}-hf: rope_theta 10000, rms_norm_eps 1e-5
    _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    # meta-llama/Meta-Llama-3-{8B,70B}: rope_theta 500000
    _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, rope_theta=500000.0),
    _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, rope_theta=500000.0),
    # meta-llama/Llama-3.1-405B: rope_scaling {rope_type llama3, factor 8, low 1, high 4, original 8192}
    _llama("llama-3.1-405b", 126, 16384, 128, 8, 53248, 128256, 131072, rope_theta=500000.0, **_LLAMA3_SCALING),
    # mistralai/Mistral-7B-v0.1: sliding_window 4096
    _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768, sliding_window=4096),
    # Qwen/Qwen2-7B: qkv biases, rope_theta 1e6, rms_norm_eps 1e-6 (use_sliding_window false)
    _llama("qwen2-7b", 28, 3584, 28, 4, 18944, 152064, 131072, rope_theta=1e6, ln_eps=1e-6, qkv_bias=True),
    # mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1: 8 experts, top 2, rope_theta 1e6, sliding_window null
    _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 32768, rope_theta=1e6, n_experts=8, moe_top_k=2),
    _llama("mixtral-8x22b", 56, 6144, 48, 8, 16384, 32768, 65536, rope_theta=1e6, n_experts=8, moe_top_k=2),
]


def _qwen3(name, n_layer, d_model, n_head, n_kv_head, d_ff, **fields):
    # Qwen/Qwen3-*: the Llama layout with q/k norms, 128-dim heads, rope_theta 1e6, rms_norm_eps 1e-6, context 40960,
    # vocabulary 151936; the MoE ones: 128 experts, top 8, norm_topk_prob true, every layer sparse
    # (decoder_sparse_step 1, mlp_only_layers [])
    return _llama(name, n_layer, d_model, n_head, n_kv_head, d_ff, 151936, 40960, d_head=128, rope_theta=1e6,
                  ln_eps=1e-6, qk_norm=True, **fields)


_QWEN3_MOE = dict(n_experts=128, moe_top_k=8, moe_renormalize=True)
QWEN3_FAMILY = [
    _qwen3("qwen3-0.6b", 28, 1024, 16, 8, 3072, tied_head=True),  # tie_word_embeddings true up to 4B
    _qwen3("qwen3-1.7b", 28, 2048, 16, 8, 6144, tied_head=True),
    _qwen3("qwen3-4b", 36, 2560, 32, 8, 9728, tied_head=True),
    _qwen3("qwen3-8b", 36, 4096, 32, 8, 12288),
    _qwen3("qwen3-14b", 40, 5120, 40, 8, 17408),
    _qwen3("qwen3-32b", 64, 5120, 64, 8, 25600),
    _qwen3("qwen3-moe-30b-a3b", 48, 2048, 32, 4, 6144, d_ff_expert=768, **_QWEN3_MOE),  # moe_intermediate_size 768
    _qwen3("qwen3-moe-235b-a22b", 94, 4096, 64, 4, 12288, d_ff_expert=1536, **_QWEN3_MOE),
]


def _gpt_oss(name, n_layer, n_experts):
    # openai/gpt-oss-{20b,120b} config.json: 64 query and 8 K/V heads of 64 dims, q/k/v/o biases and sinks, layer_types
    # alternating sliding (window 128, even layers) and full attention, top-4 experts of intermediate_size 2880 with
    # biases, a router with a bias, swiglu_limit 7, rope_theta 150000 with YaRN (factor 32 over 4096, beta 32/1,
    # truncate false), rms_norm_eps 1e-5, untied head
    return _llama(name, n_layer, 2880, 64, 8, 2880, 201088, 131072, d_head=64, rope_theta=150000.0,
                  qkv_bias=True, proj_bias=True, mlp_bias=True, attn_sinks=True, sliding_window=128,
                  sliding_window_pattern=2, n_experts=n_experts, moe_top_k=4, router_bias=True, swiglu_limit=7.0,
                  rope_scaling="yarn", rope_factor=32.0, rope_original_positions=4096, rope_truncate=False)


GPT_OSS_FAMILY = [_gpt_oss("gpt-oss-20b", 24, 32), _gpt_oss("gpt-oss-120b", 36, 128)]


def _deepseek(name, n_layer, d_model, n_head, d_ff, vocab_size, **fields):
    # MLA with 128 no-rope + 64 rotary query/key dims, 128-dim values and a 512-dim latent, rotary in pairs
    # (DeepSeek's complex form; HF's rope_interleave), YaRN x40 over a 4096 context, first layers dense
    mla = dict(d_head=192, rotary_dim=64, v_head_dim=128, kv_lora_rank=512, rotary_style="interleaved", ln_eps=1e-6,
               rope_scaling="yarn", rope_factor=40.0, rope_original_positions=4096)
    return _llama(name, n_layer, d_model, n_head, 0, d_ff, vocab_size, 163840, **{**mla, **fields})


# deepseek-ai/DeepSeek-V2-Lite, DeepSeek-V2, DeepSeek-V3 config.json (moe_intermediate_size -> d_ff_expert,
# first_k_dense_replace -> first_k_dense, topk_method, n_group, topk_group, routed_scaling_factor, rope_scaling
# mscale / mscale_all_dim). V2's softmax scale follows transformers' DeepseekV2Attention (no mscale, see
# yarn_softmax_mscale); the multi-token-prediction module of V3 (its layer 61) is not modelled, as in HF
_V2 = dict(moe_top_k=6, n_shared_experts=2, first_k_dense=1, moe_renormalize=False, rope_mscale=0.707,
           rope_mscale_all_dim=0.707, yarn_softmax_mscale=False)
DEEPSEEK_FAMILY = [
    _deepseek("deepseek-v2-lite", 27, 2048, 16, 10944, 102400, n_experts=64, d_ff_expert=1408,
              moe_topk_method="greedy", **_V2),
    _deepseek("deepseek-v2", 60, 5120, 128, 12288, 102400, q_lora_rank=1536, n_experts=160, d_ff_expert=1536,
              moe_topk_method="group_limited_greedy", moe_n_group=8, moe_topk_group=3, moe_routed_scale=16.0, **_V2),
    _deepseek("deepseek-v3", 61, 7168, 128, 18432, 129280, q_lora_rank=1536, n_experts=256, d_ff_expert=2048,
              moe_top_k=8, n_shared_experts=1, first_k_dense=3, moe_topk_method="noaux_tc", moe_n_group=8,
              moe_topk_group=4, moe_routed_scale=2.5, rope_mscale=1.0, rope_mscale_all_dim=1.0),
]

REGISTRY: dict[str, ModelConfig] = {c.name: c for c in [
    _gpt2("gpt2", 12, 768, 12), _gpt2("gpt2-medium", 24, 1024, 16),
    _gpt2("gpt2-large", 36, 1280, 20), _gpt2("gpt2-xl", 48, 1600, 25),
    _gpt3("gpt3-125m", 12, 768, 12), _gpt3("gpt3-350m", 24, 1024, 16),
    _gpt3("gpt3-760m", 24, 1536, 16), _gpt3("gpt3-1.3b", 24, 2048, 16),
    _gpt3("gpt3-2.7b", 32, 2560, 32), _gpt3("gpt3-6.7b", 32, 4096, 32),
    _gpt3("gpt3-13b", 40, 5120, 40), _gpt3("gpt3-175b", 96, 12288, 96),
    ModelConfig("gptj-6b", "gpt", 28, 4096, 16, vocab_size=50400, n_positions=2048, d_ff=16384,
                pos="rotary", rotary_dim=64, parallel_residual=True, tied_head=False,
                head_bias=True, qkv_bias=False, proj_bias=False),
    _bert("bert-base-uncased", 12, 768, 12), _bert("bert-large-uncased", 24, 1024, 16),
    *LLAMA_FAMILY, *QWEN3_FAMILY, *GPT_OSS_FAMILY, *DEEPSEEK_FAMILY,
]}
ALIASES = {"gpt2-small": "gpt2", "gpt-j-6b": "gptj-6b", "gpt-j-6B": "gptj-6b", "bert-base": "bert-base-uncased",
           "bert-large": "bert-large-uncased", "qwen3-30b-a3b": "qwen3-moe-30b-a3b",
           "qwen3-235b-a22b": "qwen3-moe-235b-a22b"}


def get_config(name: str) -> ModelConfig:
    name = ALIASES.get(name, name)
    if name not in REGISTRY:
        raise UserError(f"unknown model '{name}'; choose one of: {', '.join(REGISTRY)} (or give --model_config FILE)")
    return dataclasses.replace(REGISTRY[name])


FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}


def config_from_dict(d: dict, base: ModelConfig | None = None, source: str = "model config") -> ModelConfig:
    """A config from JSON fields; with `base`, the fields override it. Unknown or mistyped fields are errors."""
    if not isinstance(d, dict):
        raise UserError(f"{source}: expected a JSON object of model fields")
    unknown = sorted(set(d) - set(FIELDS) - {"base"})
    if unknown:
        raise UserError(f"{source}: unknown field(s) {', '.join(unknown)}; known fields: {', '.join(FIELDS)}")
    for k, v in d.items():
        if k == "base":
            continue
        typ = FIELDS[k].type
        want = (int, float) if typ is float else typ
        if not isinstance(v, want) or (typ is not bool and isinstance(v, bool)):
            raise UserError(f"{source}: field '{k}' must be {typ.__name__}, got {v!r}")
    if base is None:
        missing = [f.name for f in FIELDS.values()
                   if f.default is dataclasses.MISSING and f.name not in d]
        if missing:
            raise UserError(f"{source}: missing field(s) {', '.join(missing)} (or name a registry model in 'base')")
        fields = {k: v for k, v in d.items() if k != "base"}
        return ModelConfig(**fields)
    fields = {**base.to_dict(), **{k: v for k, v in d.items() if k != "base"}}
    fields["d_head"] = d.get("d_head", 0 if ("d_model" in d or "n_head" in d) else base.d_head)
    fields["d_ff"] = d.get("d_ff", 0 if "d_model" in d else base.d_ff)
    return ModelConfig(**fields)


def load_model_config(path: str | Path, base_name: str | None = None) -> ModelConfig:
    """--model_config FILE: a JSON object of ModelConfig fields. 'base' (or --model) names the model it overrides."""
    d = read_json(path, "model config")
    base = d.get("base", base_name) if isinstance(d, dict) else base_name
    return config_from_dict(d, get_config(base) if base else None, source=str(path))


def save_model_config(config: ModelConfig, path: str | Path) -> None:
    Path(path).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
