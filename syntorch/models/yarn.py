"""YaRN rotary scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension", §3.2-3.4), as HF's
rope_type "yarn" computes it (transformers 4.57 modeling_rope_utils._compute_yarn_parameters)."""
import math

import torch

from syntorch.config import ModelConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """The attention temperature factor 0.1 * mscale * ln(scale) + 1 (1 without scaling)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_frequencies(c: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """Per dim pair: the original frequency where a wavelength turns more than beta_fast times over the original
    context, the frequency divided by rope_factor where it turns fewer than beta_slow times, a linear ramp between."""
    r, base = c.rotary_dims, c.rope_theta

    def pair_index(rotations):  # the dim at which a wavelength turns `rotations` times over the original context
        return r * math.log(c.rope_original_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_index(c.rope_beta_fast), pair_index(c.rope_beta_slow)
    if c.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(r // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    return inv_freq / c.rope_factor * ramp + inv_freq * (1 - ramp)


def yarn_attention_factor(c: ModelConfig) -> float:
    """What HF multiplies the rotary cos and sin by (its attention_factor, inferred from the mscales)."""
    if c.rope_mscale and c.rope_mscale_all_dim:
        return yarn_mscale(c.rope_factor, c.rope_mscale) / yarn_mscale(c.rope_factor, c.rope_mscale_all_dim)
    return yarn_mscale(c.rope_factor)
