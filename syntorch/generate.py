"""Text generation: prefill the prompt once, then decode one token at a time into a static KV cache.

Greedy, temperature, top-k, top-p (seeded, so every tensor-parallel rank that sees the same logits picks
the same token), beam search with HuggingFace's semantics, and stop tokens. Works on `meta` symbolically.
The model stays plain PyTorch and owns its KV caches (models/kv_cache.py: set up for a run, reordered by beam
search, reset after it); phases are labelled through a callback.

A step's work outside the layers is traced as it runs (on meta the choice is made on the device, so the trace
and the Chakra files hold it): the new token's embedding lookup, the logits all-gathered over TP ranks, the
sampling over the whole vocabulary (a sort for top-p, a radix select for top-k, softmax, the draw), and, in a
pipeline, the chosen ids broadcast from the last stage. As in FasterTransformer's ParallelGpt (every TP rank
runs its DynamicDecodeLayer on the gathered logits with one curand seed; only the last pipeline stage sends the
ids on), tensor-parallel ranks share no ids.
"""
import contextlib
import functools
import logging
import mmap
import time
from dataclasses import dataclass

import torch

from syntorch.beam_search import Beams
from syntorch.decode_capture import CapturedForward, capturable
from syntorch.errors import UserError

log = logging.getLogger(__name__)


MIN_TEMPERATURE = 1e-30


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. temperature 0 or top_k 1 is greedy (argmax); top_k 0 and top_p 1 are off."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed (tensor-parallel ranks need one shared seed)

    def __post_init__(self):
        if not self.temperature >= 0:
            raise UserError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"--top_k must be an integer >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top_p must be in (0, 1] (1 turns it off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        # below 1e-30, float32 logits / T overflow to infinity: such a temperature samples as its limit, greedy
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


@dataclass
class GenerationResult:
    """tokens: per sequence, its prompt (without padding) followed by the generated ids. A sequence that
    produced a stop token ends with that token (so sequences may differ in length); the others have
    max_new_tokens new ids. On `meta` the ids (prompt and generated) are placeholder zeros: no values exist
    to read or choose from."""
    tokens: list[list[int]]
    prompt_lens: list[int]  # per sequence: its prompt's own length (rows of a ragged batch differ)
    prefill_s: float
    decode_s: list[float]  # one entry per decode step (the prefill produces the first new token)

    @property
    def new_tokens(self) -> list[list[int]]:
        return [seq[n:] for seq, n in zip(self.tokens, self.prompt_lens)]

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens of all sequences over the whole time, prefill included."""
        total = self.prefill_s + sum(self.decode_s)
        return sum(map(len, self.new_tokens)) / total if total > 0 else 0.0


def stream_friendly_weights(model: torch.nn.Module) -> None:
    """Keep each CPU Linear weight [out, in] as a transposed view of [in, out] memory: same shapes and values,
    but `x @ weight.t()` then runs MKL's non-transposed product, which streams the weights ~1.3x faster when
    decoding one row (bench/infer_speed.py), like HF GPT-2's Conv1D layout. That memory is one buffer on
    transparent huge pages where Linux offers them: a step streams every weight, and on 4 kB pages it misses
    the TLB once per page; a GPT-2 124M fp32 decode step (one thread) ran ~2 ms (5-6%) faster on 2 MB pages
    (bench/cpu_decode.py, 2026-11-27). Idempotent. fp32 weights only: in bf16/fp16 the same layout makes
    torch's CPU product ~4x slower, and int8 weights (quant.py) must stay [out, in].

    It moves the parameters' memory, so only the owner of a model calls it, once, after loading it for
    inference; `generate` never does (an optimizer, a training loop or a flat buffer may hold that memory)."""
    weights = {id(m.weight): m.weight for m in model.modules()  # a tied head's weight once
               if isinstance(m, torch.nn.Linear) and m.weight.device.type == "cpu"
               and m.weight.dtype == torch.float32 and m.weight.is_contiguous()}
    buffer = _huge_page_buffer(sum(w.numel() for w in weights.values()))
    offset = 0
    with torch.no_grad():
        for w in weights.values():
            memory = buffer[offset:offset + w.numel()].view(w.shape[1], w.shape[0])  # [in, out]
            memory.copy_(w.t())
            w.data = memory.t()
            offset += w.numel()


def _huge_page_buffer(numel: int) -> torch.Tensor:
    """numel float32 values on private memory advised for transparent huge pages (Linux; elsewhere, or with
    THP off, ordinary pages)."""
    if not numel or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(numel)
    area = mmap.mmap(-1, numel * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(area, dtype=torch.float32)  # the tensor keeps the mapping alive


def left_pad(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Prompts of different lengths as one [B, T] batch, each row padded on the left (so every row's next
    token goes to the same cache slot, as HuggingFace and FasterTransformer batch them), and each row's
    number of pad slots."""
    T = max(map(len, rows))
    return torch.tensor([[pad_id] * (T - len(r)) + list(r) for r in rows], dtype=torch.long), [T - len(r) for r in rows]


class Padding:
    """What a left-padded batch adds to each forward: per-row positions (a row's first real token is at
    position 0) and a mask that hides the pad slots, so every row computes what it would alone."""

    def __init__(self, pads: list[int], device):
        self.pads = torch.tensor(pads, dtype=torch.long, device=device)  # [R] pad slots per cache row

    def inputs(self, start: int, T: int) -> dict:
        """positions [R, T] and mask [R, 1, T, start+T] of the slots start..start+T (True = attend)."""
        device = self.pads.device
        slots = torch.arange(start, start + T, device=device)  # query slots
        keys = torch.arange(start + T, device=device)
        positions = (slots[None, :] - self.pads[:, None]).clamp(min=0)
        mask = (keys[None, None, :] <= slots[None, :, None]) & (keys[None, None, :] >= self.pads[:, None, None])
        mask |= keys[None, None, :] == slots[None, :, None]  # a pad slot attends to itself: its softmax stays defined
        return {"positions": positions, "mask": mask[:, None]}


class LocalForward:
    """How a step gets its logits and shares its choice when one process holds every layer: one call of the
    model, and nothing to share. A pipeline stage brings its own (parallel/pipeline_inference.py): the logits
    exist only on the last stage, which chooses and sends the choice to the others."""

    def logits(self, model, idx: torch.Tensor, start: int, inputs: dict) -> torch.Tensor:
        return model(idx, start=start, last_only=True, **inputs)[:, -1]  # [B, V]

    def share(self, choice: tuple, sizes: list[int]) -> tuple:
        return choice

    def share_rows(self, rows: list[list[int]] | None, batch: int, width: int) -> list[list[int]] | None:
        return rows


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Logits [.., V] with all but the k largest set to -inf (ties at the k-th value are kept)."""
    kth = torch.topk(logits, min(k, logits.shape[-1])).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Logits [.., V] keeping the smallest set of most likely tokens whose probability mass is >= p."""
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # a token is needed while the tokens before it hold less than p
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False  # the most likely token always stays
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def choose_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """The next token per row of float logits [B, V] on CPU: greedy, or sampled after temperature, top-k, top-p
    (HuggingFace's order)."""
    if sampling.greedy:
        return logits.argmax(-1)
    logits = logits / sampling.temperature
    if sampling.top_k:
        logits = top_k_filter(logits, sampling.top_k)
    if sampling.top_p < 1:
        logits = top_p_filter(logits, sampling.top_p)
    try:
        return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
    except RuntimeError as e:  # checked by torch as it samples: no op of ours in the trace
        if "probability tensor contains" in str(e):
            raise NonFiniteLogits from None
        raise


class NonFiniteLogits(Exception):
    """The model's logits hold NaN or infinity: nothing can be sampled from them."""


def _no_scope(_phase: str):
    return contextlib.nullcontext()


def _check_request(model, prompt: torch.Tensor, max_new_tokens: int, beam_width: int, pads) -> None:
    if prompt.dim() != 2 or prompt.shape[1] == 0 or prompt.dtype != torch.long:
        raise UserError(f"the prompt must be a [batch, tokens] LongTensor with at least one token, "
                        f"got {prompt.dtype} of shape {list(prompt.shape)}")
    if max_new_tokens < 1:
        raise UserError(f"the number of new tokens must be positive, got {max_new_tokens}")
    if beam_width < 1:
        raise UserError(f"beam_width must be positive, got {beam_width}")
    if pads is not None and (len(pads) != prompt.shape[0] or not all(0 <= p < prompt.shape[1] for p in pads)):
        raise UserError(f"pads must give 0..{prompt.shape[1] - 1} pad slots for each of the {prompt.shape[0]} "
                        f"prompt rows, got {pads}")
    check_context(model.config, prompt.shape[1], max_new_tokens, prompt.device)


def check_context(config, prompt_len: int, max_new_tokens: int, device) -> None:
    """Real runs must fit the context (an encoder generates nothing: max_new_tokens 0). A symbolic (meta) run
    may pass it -- e.g. a 2048-token prompt plus decode steps on GPT-3 -- since it studies cost, not outputs;
    the ops keep their shapes, with a warning."""
    if prompt_len + max_new_tokens <= config.n_positions:
        return
    tokens = f"{prompt_len} prompt tokens" + (f" + {max_new_tokens} new tokens" if max_new_tokens else "")
    message = f"{tokens} exceed the context of {config.name} ({config.n_positions})"
    if torch.device(device).type != "meta":
        fix = "shorten the prompt" + (" or generate fewer tokens" if max_new_tokens else "")
        raise UserError(f"{message}; {fix}")
    _warn_once(f"{message}; tracing symbolically anyway (positions past the context reuse the embedding table's shape)")


@functools.cache
def _warn_once(message: str) -> None:
    # the same run checks its prompt where it is made and where it is generated from
    log.warning("%s", message)


def generate(model, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling = Sampling(),
             stop_tokens=(), beam_width: int = 1, phase_scope=None, pads: list[int] | None = None,
             forward: LocalForward | None = None, capture: bool = True) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens after each row of `prompt` ([B, T] on the model's device).

    The prompt runs once ("prefill"); then each step ("decode[i]") feeds one token per row and writes its keys
    and values into a KV cache preallocated for the whole run. `phase_scope(name)`, if given, returns a context
    manager entered around each step (a tracer uses it to label ops). Generation ends early once every row has
    produced one of `stop_tokens`. `beam_width` > 1 runs beam search as HuggingFace's
    `generate(num_beams=N, do_sample=False)` does (stop tokens act as eos) and returns the best beam per row;
    it is deterministic, so temperature, top-k and top-p do not apply.

    `pads` (left_pad's): row b's first pads[b] slots are padding; the positions and mask make every row
    generate what it would alone, and the result holds no padding. `forward` (default LocalForward) runs a
    step's model call and shares the choice: a pipeline stage's (parallel/pipeline_inference.py).

    On `meta` no values exist: the generated ids are zeros, stop tokens never fire, and every step runs.
    The model's parameters are left as they are (values and memory); KV caches are attached for the run and
    removed after it. On CPU, `stream_friendly_weights` once after loading makes decoding faster, and a long
    enough run replays its decode steps from a captured graph (decode_capture.py), in which module hooks do not
    run: `capture=False` keeps every step eager (a traced run, with `phase_scope`, always is).
    """
    _check_request(model, prompt, max_new_tokens, beam_width, pads)
    pads = pads if pads and any(pads) else None  # without padding the model's own causal mask does it
    if capture and forward is None and phase_scope is None and beam_width == 1 and not pads \
            and capturable(model, prompt.device, max_new_tokens - 1):
        forward = CapturedForward(prompt.shape[1] + max_new_tokens, LocalForward())
    run = _Run(model, phase_scope or _no_scope, forward or LocalForward(),
               Padding([p for p in pads for _ in range(beam_width)], prompt.device) if pads else None)
    stop_tokens = torch.tensor(sorted(set(stop_tokens)), dtype=torch.long)
    with torch.inference_mode():
        model.setup_caches(prompt.shape[0] * beam_width, prompt.shape[1] + max_new_tokens)
        try:
            if beam_width > 1:
                if not sampling.greedy and sampling != Sampling(seed=sampling.seed):
                    log.warning("beam search is deterministic: temperature, top_k and top_p are not used")
                tokens = _beam_search(run, prompt, max_new_tokens, beam_width, stop_tokens)
            else:
                tokens = _sample(run, prompt, max_new_tokens, sampling, stop_tokens)
        finally:
            model.reset_caches()
    pads = pads or [0] * prompt.shape[0]
    return GenerationResult([row[p:] for row, p in zip(tokens, pads)], [prompt.shape[1] - p for p in pads],
                            run.times[0], run.times[1:])


class _Run:
    """Runs model steps, timing each and entering the phase scope around it."""

    def __init__(self, model, phase_scope, forward: LocalForward, padding: Padding | None):
        self.model = model
        self.phase_scope = phase_scope
        self.forward, self.padding = forward, padding
        self.device = next(model.parameters()).device
        self.symbolic = self.device.type == "meta"
        self.vocab_size = model.config.vocab_size
        self.times: list[float] = []

    def step(self, idx: torch.Tensor, start: int, select, sizes: list[int],
             cache_order: torch.Tensor | None = None):
        """Logits of the last position of idx (cache slots start..) handed as float32 to `select` (on CPU;
        on meta as they are, so the choice is traced too), whose result -- a tuple of 1-D long tensors of
        `sizes` -- is shared by the forward (a pipeline's last stage sends it to the others) and returned
        (None without `select`). idx is [B, T], or the [B] tokens the last step chose: they are fed in here,
        inside the step, so a trace links each step to the one that chose its input. `cache_order` (beam
        search) reorders the KV cache first, inside the step too, so its copies are traced."""
        phase = "prefill" if start == 0 else f"decode[{len(self.times) - 1}]"
        begin = time.perf_counter()
        with self.phase_scope(phase):
            if cache_order is not None:
                self.model.reorder_caches(cache_order.to(self.device))
            if idx.dim() == 1:
                idx = idx[:, None].to(self.device)  # [B, 1]
            inputs = self.padding.inputs(start, idx.shape[1]) if self.padding else {}
            logits = self.forward.logits(self.model, idx, start, inputs)  # None on a pipeline stage before the last
            chosen = None
            if select and logits is not None:
                chosen = select(self._choosable(logits))
            chosen = self.forward.share(chosen, sizes)
        self.times.append(time.perf_counter() - begin)
        return chosen

    def _choosable(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V'] as float32 [B, V], on CPU unless symbolic. A vocab-parallel head may pad the vocabulary:
        padding ids must never be chosen (a tracer records the slice even when it keeps all). The conversions
        only where they change something: on CPU even a no-op costs a decode step ~10 us, its code cold after the
        weights streamed past."""
        logits = logits[:, :self.vocab_size]
        if logits.dtype != torch.float32:
            logits = logits.float()
        return logits if self.symbolic or logits.device.type == "cpu" else logits.cpu()


def _sample(run: _Run, prompt, max_new_tokens, sampling, stop_tokens) -> list[list[int]]:
    generator = torch.Generator()  # on CPU, so a seed gives the same tokens on every device and rank
    if sampling.seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling.seed)

    def select(logits):
        try:
            return (choose_tokens(logits, sampling, generator),)
        except NonFiniteLogits:
            raise UserError(f"the logits of generated token {len(new) + 1} are not finite (NaN or infinity): "
                            "check the checkpoint's weights, or run in a wider --dtype") from None

    B, T = prompt.shape
    placeholder = torch.zeros(B, dtype=torch.long)  # meta's tokens
    finished = torch.zeros(B, dtype=torch.bool)
    # meta has no values, so no stop token can fire; without stop tokens a CPU step skips the checks' four ops
    stops = len(stop_tokens) and not run.symbolic
    idx, new = prompt, []
    while True:
        token, = run.step(idx, T + len(new) - 1 if new else 0, select, [B])
        if stops:
            finished |= torch.isin(token, stop_tokens)
        new.append(placeholder if run.symbolic else token)
        if len(new) == max_new_tokens or stops and finished.all():
            break
        idx = token  # [B]: the next step feeds it
    rows = torch.cat((_known(prompt), torch.stack(new, 1)), 1).tolist()
    return rows if run.symbolic else [_cut_after_stop(row, T, stop_tokens.tolist()) for row in rows]


def _known(prompt: torch.Tensor) -> torch.Tensor:
    """The prompt on CPU; zeros on meta, where its values are unknown."""
    return torch.zeros(prompt.shape, dtype=torch.long) if prompt.is_meta else prompt.cpu()


def _cut_after_stop(row: list[int], prompt_len: int, stop_tokens: list[int]) -> list[int]:
    for i in range(prompt_len, len(row)):
        if row[i] in stop_tokens:
            return row[:i + 1]
    return row


def _beam_search(run: _Run, prompt, max_new_tokens, beam_width, stop_tokens) -> list[list[int]]:
    """The best beam per prompt row. Row b's beams are cache rows b*N .. b*N+N-1; after each step the cache
    rows are reordered to follow the beams they continue."""
    B, T = prompt.shape
    R = B * beam_width
    beams = None if run.symbolic else Beams(prompt.cpu(), beam_width, T + max_new_tokens, stop_tokens)
    idx, rows = prompt.repeat_interleave(beam_width, 0), None  # [R, T]: every beam starts from its row's prompt
    for i in range(max_new_tokens):
        chosen = run.step(idx, T + i - 1 if i else 0, beams.update if beams else None, [R, R, 1], cache_order=rows)
        if (bool(chosen[2]) if beams else i == max_new_tokens - 1):
            break
        # [R] tokens and the cache row each beam continues; the next step feeds them
        idx, rows = chosen[:2] if beams else (torch.zeros(R, dtype=torch.long), torch.arange(R))
    if beams is None:  # meta: placeholders of full length
        return torch.cat((_known(prompt), torch.zeros(B, max_new_tokens, dtype=torch.long)), 1).tolist()
    # the best beams are known where the choices were made (a pipeline's last stage), which shares them
    return run.forward.share_rows(beams.best() if beams.chooses else None, B, T + max_new_tokens)
