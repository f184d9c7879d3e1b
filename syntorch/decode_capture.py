"""A CPU decode step captured once per run (issue 24): the `torch.jit.trace` of one decode step replays every
later step without Python. A GPT-2 124M fp32 step runs ~300 small ops between its matrix products, and each
pays Python, nn.Module calls and dispatch, cold after the weights streamed past evicted the caches; the traced
graph runs the same aten ops (the same logits, bit for bit) without that Python.

Measured on GPT-2 124M, fp32, batch 1, one thread, CPU time on a loaded machine: the step that is traced
takes 65 ms more than an eager step (a module's trace and `torch.jit.freeze` took 0.27 s and saved no more);
each later step is 1.8-3.4 ms faster when both run alternately in one process (0.6-2.4 ms between the
processes of bench/cpu_decode.py, whose load differs); so capture pays back after 20-36 steps (up to ~100).
It is used only where it pays (`MIN_STEPS`) and only where one traced step holds every later one: the decode
steps differ only in their cache slot, which the step reads from the length of its `slots` input (the tracer
records a tensor's size as a graph value, so the slot stays an input of the graph, not a constant).
Everything else keeps eager: prefill, beam search, padded batches, sliding windows (the mask depends on the
slot), mixture-of-experts (routing is data-dependent), models with hooks (tracing, tensor parallelism) or
more than one process.
"""
import logging
import warnings

import torch


log = logging.getLogger(__name__)

# about the highest break-even measured (above), so the capture pays for itself even on a loaded machine
MIN_STEPS = 96


def capturable(model, device: torch.device, steps: int) -> bool:
    """Whether `steps` decode steps of `model` on `device` run the captured step: on CPU, in one process, and
    a step that depends on its cache slot only through the slot's index (generate() also keeps traced runs
    and `capture=False` eager)."""
    c = model.config
    if device.type != "cpu" or steps < MIN_STEPS or torch.distributed.is_initialized():
        return False
    return not (c.encoder or c.n_experts or c.mla or any(c.layer_window(i) for i in range(c.n_layer)))


class CapturedForward:
    """generate()'s LocalForward `eager` with its decode steps after the first run from the trace of the first;
    the prefill and the first decode step run eagerly (the first is traced as it runs). If tracing fails, every
    step runs eagerly."""

    def __init__(self, max_seq: int, eager):
        self.eager = eager
        self.share, self.share_rows = eager.share, eager.share_rows
        self.step = None
        self.failed = False
        self.slots = torch.empty(max_seq, 0)  # sliced to a step's slot count; holds no memory

    def logits(self, model, idx: torch.Tensor, start: int, inputs: dict) -> torch.Tensor:
        if start == 0 or inputs or self.failed:
            return self.eager.logits(model, idx, start, inputs)
        slots = self.slots[:start + 1]
        if self.step is None:
            return self._capture(model, idx, slots)
        # the graph's shapes change every step: the profiling executor would re-profile it for nothing
        with torch.jit.optimized_execution(False):
            return self.step(idx, slots)

    def _capture(self, model, idx, slots) -> torch.Tensor:
        traced_run = []

        def step(idx, slots):  # the cache slot as a size: the trace keeps it an input of the graph
            logits = model(idx, start=slots.shape[0] - 1, last_only=True)[:, -1]
            traced_run.append(logits)  # Python, so only while tracing: the traced run's logits are this step's
            return logits

        # a function's trace holds the weights as constants (the same tensors, no copy), which may not require grad
        trainable = [p for p in model.parameters() if p.requires_grad]
        try:
            for p in trainable:
                p.requires_grad_(False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the slot's size as a value is intended
                warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 points to torch.compile: 120 s here
                self.step = torch.jit.trace(step, (idx, slots), check_trace=False)
        except RuntimeError as e:
            log.warning("decode step capture failed, decoding eagerly: %s", e)
            self.failed = True
        finally:
            for p in trainable:
                p.requires_grad_(True)
        if self.failed:  # rerun whole: the failed trace may have written part of this slot, which is rewritten
            return self.eager.logits(model, idx, slots.shape[0] - 1, {})
        return traced_run[0]
