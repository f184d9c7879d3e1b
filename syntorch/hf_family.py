"""The record every HuggingFace family table is made of (hf_format.py, hf_deepseek.py); config.json values are
read through hf_values.py."""
from dataclasses import dataclass, field


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
    stacked: dict = field(default_factory=dict)  # our expert module -> the HF tensor holding every expert (hf_stacked)
