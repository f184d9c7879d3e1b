"""YaRN rotary scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models",
section 3), as HuggingFace's _compute_yarn_parameters computes it (rope_type "yarn": GPT-OSS, Qwen3 beyond 32k)."""
import math

import torch

from syntorch.config import ModelConfig


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
    """What cos and sin are multiplied by (so each q.k logit by its square): the stated factor, else the paper's
    0.1 ln(s) + 1 (1 for s <= 1)."""
    if c.rope_attention_factor:
        return c.rope_attention_factor
    return 0.1 * math.log(c.rope_factor) + 1.0 if c.rope_factor > 1 else 1.0
