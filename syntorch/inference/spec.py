"""What one inference run is (InferenceSpec) and its steps: find the model, make the prompt, run it (a decoder
generates; an encoder predicts its masked tokens in one pass), record.

Every way of running (one rank, real ranks, symbolic; inference/run.py) goes through these, so scripts and
the tensor-parallel ranks run exactly the same steps.
"""
import json
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import torch

from syntorch.checkpoints import check_shard_layout, resolve_model_config
from syntorch.config import ModelConfig, torch_dtype
from syntorch.errors import UserError
from syntorch.fill_mask import predict_masked
from syntorch.generate import Sampling, check_context, generate, left_pad
from syntorch.parallel.assemble import RankPlan, assemble_rank
from syntorch.parallel.mesh import Mesh, MeshGroups
from syntorch.parallel.tensor import check_sp
from syntorch.quant import check_quant, quantize_int8_weight_only
from syntorch.shard_files import load_rank_model
from syntorch.userfiles import read_lines

DEFAULT_OUTPUT_TOKENS = 20  # seed 000's --num_output_tokens
# what only a decoder's generation reads
GENERATION_OPTIONS = ("num_output_tokens", "temperature", "top_k", "top_p", "beam_width", "stop_tokens")


@dataclass
class InferenceSpec:
    model: str = "gpt3-125m"
    model_config: str | None = None  # JSON file overriding or defining the model
    checkpoint: str | None = None  # HuggingFace directory
    device: str = "cpu"
    dtype: str = "fp32"  # fp8: bf16 weights, Linear GEMMs in FP8 (parallel/fp8.py)
    num_input_tokens: int = 10
    num_output_tokens: int | None = None  # None: DEFAULT_OUTPUT_TOKENS for a decoder; an encoder takes none
    batch_size: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    beam_width: int = 1
    stop_tokens: list[int] = field(default_factory=list)
    input_ids: list[int] | list[list[int]] | None = None  # one prompt's ids, or one list per prompt
    prompt: str | list[str] | None = None  # one text or several
    prompt_file: str | None = None  # text, one prompt per line
    tokenizer: str | None = None  # local HF tokenizer folder (tokenizer.json)
    tp: int = 1
    sp: bool = False
    pp: int = 1
    quant: str | None = None  # "int8_weight_only" (syntorch/quant.py)
    quant_head: bool = False  # quantize the LM head too

    def __post_init__(self):
        """Every option's own check, once, when the spec is made."""
        if self.num_input_tokens <= 0 and not self.input_ids and not self.prompt and not self.prompt_file:
            raise UserError(f"--num_input_tokens must be positive, got {self.num_input_tokens}")
        if self.num_output_tokens is not None and self.num_output_tokens <= 0:
            raise UserError(f"--num_output_tokens must be positive, got {self.num_output_tokens}")
        if self.batch_size <= 0:
            raise UserError(f"--batch_size must be positive, got {self.batch_size}")
        if self.beam_width <= 0:
            raise UserError(f"--beam_width must be positive, got {self.beam_width}")
        for flag in ("tp", "pp"):
            if getattr(self, flag) <= 0:
                raise UserError(f"--{flag} must be positive, got {getattr(self, flag)}")
        if not 0 <= self.seed < 2**63:  # what torch's generators take
            raise UserError(f"--seed must be in 0..2**63-1, got {self.seed}")
        check_sp(self.sp, self.tp)
        torch_dtype(self.dtype)
        given = [f for f in ("input_ids", "prompt", "prompt_file") if getattr(self, f) is not None]
        if len(given) > 1:
            raise UserError(f"give either --{given[0]} or --{given[1]}, not both")
        for flag in ("prompt", "prompt_file"):
            if getattr(self, flag) is not None and self.tokenizer is None:
                raise UserError(f"--{flag} needs --tokenizer DIR (a local HuggingFace tokenizer folder)")
        check_device(self.device)
        check_quant(self.quant, self.quant_head, self.device)
        if self.quant and self.dtype == "fp8":  # two weight formats: int8 with scales, or FP8 (assemble.py)
            raise UserError(f"--quant {self.quant} and --dtype fp8 each set the weights' format; choose one")

    @property
    def rank_plan(self) -> RankPlan:
        """What shapes each rank's model (assemble.py): an inference over --tp x --pp, FP8 weights cast once."""
        return RankPlan(tp=self.tp, pp=self.pp, sp=self.sp, mode="infer", fp8=self.dtype == "fp8", fp8_cast_once=True)

    @property
    def output_tokens(self) -> int:
        """How many tokens a decoder generates."""
        return DEFAULT_OUTPUT_TOKENS if self.num_output_tokens is None else self.num_output_tokens


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


def check_fits_model(spec: InferenceSpec, config: ModelConfig) -> None:
    """An encoder generates nothing, so generation options given with one are a mistake worth one line (not
    silently ignored). "Given" is "not the default": --num_output_tokens defaults to None for this; a
    sampling option given at its default value (--temperature 1) goes unnoticed, and changes nothing."""
    if not config.encoder:
        return
    given = [f"--{f.name}" for f in fields(spec)
             if f.name in GENERATION_OPTIONS and getattr(spec, f.name) != _default(f)]
    if given:
        raise UserError(f"{config.name} is an encoder: encoders predict masked tokens in one pass and generate "
                        f"nothing; drop {', '.join(given)}")


def _default(f):
    return f.default_factory() if f.default is MISSING else f.default


def load_model(spec: InferenceSpec, config: ModelConfig, groups: MeshGroups | None = None):
    """The model this rank runs (assemble.assemble_rank under spec.rank_plan): over `groups`, this rank's
    MeshGroups of the --tp x --pp mesh (None: one rank), TP-sharded and cut to its stage, in FP8 if asked.
    From --checkpoint each rank reads only its own weights (its file of a `syntorch shard` folder, or its
    slices of a HuggingFace folder); random weights are drawn whole from the seed, as one process draws them,
    then cut."""
    dtype = torch_dtype(spec.dtype)
    if spec.checkpoint:
        return load_rank_model(config, spec.checkpoint, spec.device, dtype, groups, spec.rank_plan)
    torch.manual_seed(spec.seed)
    return assemble_rank(config, spec.rank_plan, groups or MeshGroups(Mesh(), 0), spec.device, dtype).model


def check_checkpoint_layout(spec: InferenceSpec) -> None:
    """A `syntorch shard` folder serves only the --tp/--pp it was cut for, with every rank's file whole."""
    if spec.checkpoint:
        check_shard_layout(spec.checkpoint, spec.tp, spec.pp)


@dataclass
class Prompt:
    """The batch a run feeds: ids [B, T], each row padded by pads[b] slots when the prompts differ in length:
    on the left for a decoder (generate.left_pad), on the right for an encoder (`right`)."""
    ids: torch.Tensor
    pads: list[int]
    right: bool = False

    @property
    def rows(self) -> list[list[int]]:
        """Each prompt's own ids, without padding."""
        T = self.ids.shape[1]
        return [row[:T - p] if self.right else row[p:] for row, p in zip(self.ids.tolist(), self.pads)]


MAX_PROMPT_IDS = 2**28  # 2 GiB of int64 ids: beyond it the prompt alone fills a machine, even on meta


def check_batch_size(spec: InferenceSpec, config: ModelConfig, prompt_len: int) -> None:
    """Before anything is allocated: the prompt ids, and on a real device the KV cache against the memory
    this machine has free (a MemoryError or the OOM killer otherwise)."""
    import psutil

    tokens = spec.batch_size * prompt_len
    if tokens > MAX_PROMPT_IDS:
        raise UserError(f"--batch_size {spec.batch_size} x {prompt_len} prompt tokens is {tokens:.3g} ids, over "
                        f"{MAX_PROMPT_IDS:.3g}; lower --batch_size")
    if torch.device(spec.device).type != "cpu":
        return
    per_token = 2 * config.n_layer * config.kv_heads * config.d_head * torch_dtype(spec.dtype).itemsize
    need = spec.batch_size * (prompt_len + (spec.num_output_tokens or DEFAULT_OUTPUT_TOKENS)) * per_token
    free = psutil.virtual_memory().available
    if need > free:
        raise UserError(f"the KV cache of --batch_size {spec.batch_size} needs {need / 1e9:.3g} GB but this machine "
                        f"has {free / 1e9:.3g} GB free; lower --batch_size or the token counts, or use --device meta")


def make_prompt(spec: InferenceSpec, config: ModelConfig) -> Prompt:
    """The prompts: --input_ids, --prompt or --prompt_file via --tokenizer, or random ids drawn from the
    seed; one prompt is repeated --batch_size times, several make the batch."""
    rows = _prompt_rows(spec, config)
    if any(not row for row in rows):
        raise UserError("the prompt is empty; give at least one token")
    prompt_flag = "--input_ids" if spec.input_ids is not None else "prompt"
    for flag, tokens in ((prompt_flag, [i for row in rows for i in row]), ("--stop_tokens", spec.stop_tokens)):
        bad = [i for i in tokens if not 0 <= i < config.vocab_size]
        if bad:
            raise UserError(f"{flag} token id {bad[0]} is outside the vocabulary of {config.name} "
                            f"(0..{config.vocab_size - 1})")
    check_context(config, max(map(len, rows)), 0 if config.encoder else spec.output_tokens, spec.device)
    check_batch_size(spec, config, max(map(len, rows)))
    if len(rows) == 1:
        rows = rows * spec.batch_size
    elif spec.batch_size not in (1, len(rows)):
        raise UserError(f"--batch_size {spec.batch_size} does not match the {len(rows)} prompts given; "
                        "several prompts make the batch, drop --batch_size")
    if config.encoder:  # right-padded, as HuggingFace pads BERT: its positions count from the left
        T = max(map(len, rows))
        return Prompt(torch.tensor([r + [0] * (T - len(r)) for r in rows], dtype=torch.long),
                      [T - len(r) for r in rows], right=True)
    return Prompt(*left_pad(rows))


def _prompt_rows(spec: InferenceSpec, config: ModelConfig) -> list[list[int]]:
    if spec.input_ids is not None:
        ids = list(spec.input_ids)
        return [list(row) for row in ids] if ids and isinstance(ids[0], list) else [ids]
    texts = read_lines(spec.prompt_file, "--prompt_file") if spec.prompt_file is not None else spec.prompt
    if texts is not None:
        tokenizer = load_tokenizer(spec.tokenizer)
        return [tokenizer.encode(t, add_special_tokens=config.encoder).ids
                for t in ([texts] if isinstance(texts, str) else texts)]
    g = torch.Generator().manual_seed(spec.seed)
    return [torch.randint(0, config.vocab_size, (spec.num_input_tokens,), generator=g).tolist()]


def load_tokenizer(folder: str):
    from tokenizers import Tokenizer
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"no tokenizer.json in {folder}; give a HuggingFace tokenizer folder saved by save_pretrained")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exceptions for malformed files
        raise UserError(f"cannot read tokenizer {path}: {str(e).splitlines()[0]}") from None


def encode(folder: str, text: str, special_tokens: bool = False) -> list[int]:
    """Token ids of `text`; with `special_tokens` the tokenizer's own template around them (BERT's
    [CLS] … [SEP], as HuggingFace's fill-mask pipeline feeds an encoder)."""
    return load_tokenizer(folder).encode(text, add_special_tokens=special_tokens).ids


def decode(folder: str, ids: list[int]) -> str:
    return load_tokenizer(folder).decode(ids)


def sampling_of(spec: InferenceSpec) -> Sampling:
    return Sampling(temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p, seed=spec.seed)


def generate_tokens(spec: InferenceSpec, model, prompt: Prompt, phase_scope=None, forward=None):
    return generate(model, prompt.ids.to(spec.device), spec.output_tokens, sampling_of(spec),
                    stop_tokens=tuple(spec.stop_tokens), beam_width=spec.beam_width, phase_scope=phase_scope,
                    pads=prompt.pads, forward=forward)


def mask_token_id(spec: InferenceSpec, config: ModelConfig) -> int:
    """The id of [MASK]: the tokenizer's when one is given (it made the ids), else the model config's."""
    found = load_tokenizer(spec.tokenizer).token_to_id("[MASK]") if spec.tokenizer else None
    return config.mask_token_id if found is None else found


def run_model(spec: InferenceSpec, config: ModelConfig, model, prompt: Prompt, phase_scope=None, forward=None):
    """What the model does at inference, the same in every kind of run: a decoder generates
    (GenerationResult), an encoder predicts its masked tokens in one pass (MaskedPrediction). `forward`:
    a pipeline stage's (generate.LocalForward otherwise). `model` is assembled under spec.rank_plan (FP8
    included) by load_model, or for a symbolic run by the tracer (trace/generation.py)."""
    if spec.quant:  # here, after assembly, so a symbolic run (whose model the tracer builds) quantizes too
        quantize_int8_weight_only(model, head=spec.quant_head)
    if config.encoder:
        return predict_masked(model, prompt.ids, mask_token_id(spec, config), phase_scope=phase_scope,
                              lengths=[len(row) for row in prompt.rows])
    return generate_tokens(spec, model, prompt, phase_scope, forward)


def run_record(spec: InferenceSpec, config: ModelConfig, prompt: Prompt, result) -> dict:
    """What run.json holds: the run's identity, what the model produced and its measured timings. A symbolic
    run (meta) has neither values nor a speed worth reporting (its wall time is the tracer's): it records
    the prompt and what was traced; its latency is predicted from --hw_config (run.json's trace)."""
    record = {
        "model": config.name, "device": spec.device, "dtype": spec.dtype, "tp": spec.tp, "pp": spec.pp,
        "batch_size": len(prompt.pads), "seed": spec.seed,
        "input_ids": prompt.rows, "model_config": config.to_dict(),
    }
    if spec.quant:
        record["quant"] = {"mode": spec.quant, "head": spec.quant_head}
    symbolic = torch.device(spec.device).type == "meta"
    if symbolic:
        record["symbolic"] = True
    if config.encoder:
        return {**record, **_encoder_record(spec, config, prompt, result, symbolic)}
    return {**record, **_decoder_record(spec, prompt, result, symbolic)}


def _decoder_record(spec: InferenceSpec, prompt: Prompt, result, symbolic: bool) -> dict:
    sampling = {"temperature": spec.temperature, "top_k": spec.top_k, "top_p": spec.top_p,
                "beam_width": spec.beam_width, "stop_tokens": spec.stop_tokens}
    if symbolic:
        return {"sampling": sampling, "output_tokens_traced": len(result.decode_s) + 1}
    # the prompt from our side, then the generated ids
    outputs = [row + list(map(int, new)) for row, new in zip(prompt.rows, result.new_tokens)]
    decode_ms = [s * 1e3 for s in result.decode_s]
    record = dict(sampling=sampling, output_ids=outputs, prefill_ms=result.prefill_s * 1e3,
                  decode_ms_per_token=sum(decode_ms) / len(decode_ms) if decode_ms else 0.0,
                  tokens_per_s=result.tokens_per_s)
    if spec.tokenizer:
        record["output_text"] = [decode(spec.tokenizer, seq) for seq in outputs]
    return record


def _encoder_record(spec: InferenceSpec, config: ModelConfig, prompt: Prompt, result, symbolic: bool) -> dict:
    """Per prompt row, the positions predicted and (on a real device) each one's top ids, probabilities and,
    with --tokenizer, tokens; with a mask in the prompt also the text with each mask filled by its best."""
    record = {"mask_token_id": mask_token_id(spec, config), "predicted_positions": "masked" if result.masked else "all"}
    if symbolic:
        return {**record, "positions": result.positions}
    tokenizer = load_tokenizer(spec.tokenizer) if spec.tokenizer else None
    record["predictions"] = [[_prediction(*at, tokenizer) for at in zip(*row)]
                             for row in zip(result.positions, result.top_ids, result.top_probs)]
    record["encode_ms"] = result.encode_s * 1e3
    if tokenizer and result.masked:
        record["filled_text"] = [tokenizer.decode(_filled(ids, row)) for ids, row in zip(prompt.rows,
                                                                                         record["predictions"])]
    return record


def _prediction(position: int, ids: list[int], probs: list[float], tokenizer) -> dict:
    entry = {"position": position, "ids": ids, "probs": probs}
    if tokenizer:
        entry["tokens"] = [tokenizer.id_to_token(i) for i in ids]
    return entry


def _filled(ids: list[int], predictions: list[dict]) -> list[int]:
    """The prompt row with each predicted position holding its most likely token."""
    ids = list(ids)
    for p in predictions:
        ids[p["position"]] = p["ids"][0]
    return ids


def write_run_json(record: dict, out_dir: Path) -> None:
    (Path(out_dir) / "run.json").write_text(json.dumps(record, indent=2) + "\n")
