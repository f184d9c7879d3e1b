"""What every HuggingFace family table is made of (hf_format.py, hf_deepseek.py): the Family record and the
checks that read config.json fields."""
from dataclasses import dataclass, field

from syntorch.errors import UserError


@dataclass(frozen=True, eq=False)
class Family:
    model_type: str  # config.json "model_type"
    architecture: str  # config.json "architectures" entry we write and recognise
    flags: dict  # ModelConfig fields the HF class fixes; a config that differs has no HF equivalent
    body: str  # prefix of the base model's keys ("transformer."), absent when a base model was saved
    head: str  # prefix of the LM head's keys, which never carry `body`
    modules: dict  # our module -> HF module; "{i}" the block, "{e}" the expert index; a tuple: HF modules fused into
    # ours along the output dim (q, k, v into qkv; gate, up into a gated fc1)
    conv1d: tuple = ()  # our modules whose HF weight is stored [in, out] (GPT-2's Conv1D)
    params: dict = field(default_factory=dict)  # our parameter -> HF parameter where the module rule is wrong
    ignored: str = r"$^"  # HF keys that are buffers, tied copies or heads our model does not have
    tied: str = ""  # HF key of the LM head weight, which HF ties to the embedding


def _require(hf_config: dict, key: str, allowed, default):
    value = hf_config.get(key, default)
    if value not in allowed:
        raise UserError(f"config.json: {key}={value!r} is not supported by syntorch's model "
                        f"(supported: {', '.join(map(repr, allowed))})")
    return value


def _size(hf_config: dict, key: str, default=None) -> int:
    value = hf_config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _eps(hf_config: dict, key: str, default: float | None = None) -> float:
    value = hf_config.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise UserError(f"config.json: {key} must be a positive number, got {value!r}")
    return float(value)
