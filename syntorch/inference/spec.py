"""What one inference run is (InferenceSpec) and its steps: find the model, make the prompt, generate, record.

Every way of running (one rank, real ranks, symbolic; inference/run.py) goes through these, so scripts and
the tensor-parallel ranks run exactly the same steps.
"""
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from syntorch.checkpoints import load_checkpoint, resolve_model_config
from syntorch.config import ModelConfig, torch_dtype
from syntorch.errors import UserError
from syntorch.generate import Sampling, check_context, generate
from syntorch.models import build_model
from syntorch.parallel.tensor import check_sp


@dataclass
class InferenceSpec:
    model: str = "gpt3-125m"
    model_config: str | None = None  # JSON file overriding or defining the model
    checkpoint: str | None = None  # HuggingFace directory
    device: str = "cpu"
    dtype: str = "fp32"
    num_input_tokens: int = 10
    num_output_tokens: int = 20
    batch_size: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    beam_width: int = 1
    stop_tokens: list[int] = field(default_factory=list)
    input_ids: list[int] | None = None
    prompt: str | None = None
    tokenizer: str | None = None  # local HF tokenizer folder (tokenizer.json)
    tp: int = 1
    sp: bool = False

    def __post_init__(self):
        """Every option's own check, once, when the spec is made."""
        if self.num_input_tokens <= 0 and not self.input_ids and not self.prompt:
            raise UserError(f"--num_input_tokens must be positive, got {self.num_input_tokens}")
        if self.num_output_tokens <= 0:
            raise UserError(f"--num_output_tokens must be positive, got {self.num_output_tokens}")
        if self.batch_size <= 0:
            raise UserError(f"--batch_size must be positive, got {self.batch_size}")
        if self.beam_width <= 0:
            raise UserError(f"--beam_width must be positive, got {self.beam_width}")
        if self.tp <= 0:
            raise UserError(f"--tp must be positive, got {self.tp}")
        if not 0 <= self.seed < 2**63:  # what torch's generators take
            raise UserError(f"--seed must be in 0..2**63-1, got {self.seed}")
        check_sp(self.sp, self.tp)
        torch_dtype(self.dtype)
        if self.prompt is not None and self.tokenizer is None:
            raise UserError("--prompt needs --tokenizer DIR (a local HuggingFace tokenizer folder)")
        if self.input_ids is not None and self.prompt is not None:
            raise UserError("give either --input_ids or --prompt, not both")
        check_device(self.device)


def check_device(device: str) -> None:
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise UserError(f"unknown --device {device!r}; use cpu, cuda or meta") from None
    if kind not in ("cpu", "cuda", "meta"):
        raise UserError(f"unsupported --device {device!r}; use cpu, cuda or meta")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was given but CUDA is not available here; use --device cpu or meta")


def resolve_config(spec: InferenceSpec) -> ModelConfig:
    return resolve_model_config(spec.model, spec.model_config, spec.checkpoint)


def load_model(spec: InferenceSpec, config: ModelConfig):
    """The full (unsharded) model: loaded from --checkpoint, or random with the seed."""
    if spec.checkpoint:
        return load_checkpoint(spec.checkpoint, device=spec.device, dtype=torch_dtype(spec.dtype))[1]
    torch.manual_seed(spec.seed)
    return build_model(config, device=spec.device, dtype=torch_dtype(spec.dtype))


def make_prompt(spec: InferenceSpec, config: ModelConfig) -> torch.Tensor:
    """[batch, T] token ids: --input_ids, --prompt via --tokenizer, or random ids drawn from the seed."""
    if spec.input_ids is not None:
        ids = list(spec.input_ids)
    elif spec.prompt is not None:
        ids = encode(spec.tokenizer, spec.prompt)
    else:
        g = torch.Generator().manual_seed(spec.seed)
        ids = torch.randint(0, config.vocab_size, (spec.num_input_tokens,), generator=g).tolist()
    if not ids:
        raise UserError("the prompt is empty; give at least one token")
    prompt_flag = "--input_ids" if spec.input_ids is not None else "prompt"
    for flag, tokens in ((prompt_flag, ids), ("--stop_tokens", spec.stop_tokens)):
        bad = [i for i in tokens if not 0 <= i < config.vocab_size]
        if bad:
            raise UserError(f"{flag} token id {bad[0]} is outside the vocabulary of {config.name} "
                            f"(0..{config.vocab_size - 1})")
    check_context(config, len(ids), spec.num_output_tokens, spec.device)
    return torch.tensor([ids] * spec.batch_size, dtype=torch.long)


def load_tokenizer(folder: str):
    from tokenizers import Tokenizer
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"no tokenizer.json in {folder}; give a HuggingFace tokenizer folder saved by save_pretrained")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exceptions for malformed files
        raise UserError(f"cannot read tokenizer {path}: {str(e).splitlines()[0]}") from None


def encode(folder: str, text: str) -> list[int]:
    return load_tokenizer(folder).encode(text, add_special_tokens=False).ids


def decode(folder: str, ids: list[int]) -> str:
    return load_tokenizer(folder).decode(ids)


def sampling_of(spec: InferenceSpec) -> Sampling:
    return Sampling(temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p, seed=spec.seed)


def generate_tokens(spec: InferenceSpec, model, prompt: torch.Tensor, phase_scope=None):
    return generate(model, prompt.to(spec.device), spec.num_output_tokens, sampling_of(spec),
                    stop_tokens=tuple(spec.stop_tokens), beam_width=spec.beam_width, phase_scope=phase_scope)


def run_record(spec: InferenceSpec, config: ModelConfig, prompt: torch.Tensor, result) -> dict:
    """What run.json holds: the run's identity, its tokens and its measured timings. A symbolic run (meta)
    has neither token values nor a speed worth reporting (its wall time is the tracer's): it records the
    prompt and the number of steps traced; its latency is predicted from --hw_config (run.json's trace)."""
    record = {
        "model": config.name, "device": spec.device, "dtype": spec.dtype, "tp": spec.tp,
        "batch_size": spec.batch_size, "seed": spec.seed,
        "sampling": {"temperature": spec.temperature, "top_k": spec.top_k, "top_p": spec.top_p,
                     "beam_width": spec.beam_width, "stop_tokens": spec.stop_tokens},
        "input_ids": prompt.tolist(), "model_config": config.to_dict(),
    }
    if torch.device(spec.device).type == "meta":
        return {**record, "symbolic": True, "output_tokens_traced": len(result.decode_s) + 1}
    # the prompt from our side, then the generated ids
    outputs = [row + list(map(int, new)) for row, new in zip(prompt.tolist(), result.new_tokens)]
    decode_ms = [s * 1e3 for s in result.decode_s]
    record.update(output_ids=outputs, prefill_ms=result.prefill_s * 1e3,
                  decode_ms_per_token=sum(decode_ms) / len(decode_ms) if decode_ms else 0.0,
                  tokens_per_s=result.tokens_per_s)
    if spec.tokenizer:
        record["output_text"] = [decode(spec.tokenizer, seq) for seq in outputs]
    return record


def write_run_json(record: dict, out_dir: Path) -> None:
    (Path(out_dir) / "run.json").write_text(json.dumps(record, indent=2) + "\n")
