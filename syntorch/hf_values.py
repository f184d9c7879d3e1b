"""Checked reads of config.json values: one line naming the key and the value when syntorch cannot use it."""
from syntorch.errors import UserError


def require(hf_config: dict, key: str, allowed, default):
    value = hf_config.get(key, default)
    if value not in allowed:
        raise UserError(f"config.json: {key}={value!r} is not supported by syntorch's model "
                        f"(supported: {', '.join(map(repr, allowed))})")
    return value


def size(hf_config: dict, key: str, default=None) -> int:
    value = hf_config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def eps(hf_config: dict, key: str, default: float | None = None) -> float:
    value = hf_config.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise UserError(f"config.json: {key} must be a positive number, got {value!r}")
    return float(value)
