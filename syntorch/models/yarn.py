"""YaRN rotary scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models",
§3.2-3.4), as transformers 4.57's modeling_rope_utils._compute_yarn_parameters computes it for every rope_type
"yarn" model (GPT-OSS, Qwen3 beyond 32k, DeepSeek-V2/V3), DeepSeek's mscale form of the attention factor included."""
import math

import torch

from syntorch.config import ModelConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """The attention temperature factor 0.1 * mscale * ln(scale) + 1 (1 without scaling): HF's get_mscale."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _dim_turning(rotations: float, c: ModelConfig) -> float:
    """The (fractional) dim pair index whose wavelength fits `rotations` times into the original context."""
    r = c.rotary_dims
    return r * math.log(c.rope_original_positions / (rotations * 2 * math.pi)) / (2 * math.log(c.rope_theta))


def yarn_frequencies(inv_freq: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    """inv_freq [r/2] scaled: pairs turning more than beta_fast times over the original context keep their
    frequency, those turning fewer than beta_slow times are slowed by rope_factor, a linear ramp between."""
    low, high = _dim_turning(c.rope_beta_fast, c), _dim_turning(c.rope_beta_slow, c)
    if c.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, c.rotary_dims - 1)
    if low == high:  # HF's guard against a zero-width ramp
        high += 0.001
    ramp = ((torch.arange(len(inv_freq), dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    return inv_freq / c.rope_factor * ramp + inv_freq * (1 - ramp)


def yarn_attention_factor(c: ModelConfig) -> float:
    """What cos and sin are multiplied by (so each q.k logit by its square), as HF infers its attention_factor:
    the stated one; else, with both mscales set (DeepSeek), mscale(s, mscale) / mscale(s, mscale_all_dim);
    else the paper's 0.1 ln(s) + 1 (1 for s <= 1)."""
    if c.rope_attention_factor:
        return c.rope_attention_factor
    if c.rope_mscale and c.rope_mscale_all_dim:
        return yarn_mscale(c.rope_factor, c.rope_mscale) / yarn_mscale(c.rope_factor, c.rope_mscale_all_dim)
    return yarn_mscale(c.rope_factor)
