"""FP8 GEMMs as Transformer Engine runs its Linear layers (`--dtype fp8`), applied to a finished model as TP is.

The model stays in BF16 (weights, activations, everything that is not a Linear's GEMM; the optimizer keeps FP32
masters, precision.py). Each Linear's product runs in FP8 with per-tensor scaling (TE's DelayedScaling recipe,
format HYBRID, the one NeMo and Megatron-LM use): forward inputs and weights in e4m3, gradients in e5m2. Every
tensor entering an FP8 GEMM goes through TE's steps, each recorded in the trace as the aten op it is:
- its amax (max |x|, one reduction: aten.linalg_vector_norm with ord=inf), kept in a running maximum (TE keeps a
  window of 1,024 steps' amaxes and takes their max: the same until the window fills);
- its scale from that history: scale_inv = amax / FP8_MAX (aten.div), what the GEMM dequantizes with;
- the cast x / scale_inv -> float8 (aten.div + aten._to_copy: 1 byte per element out);
- (weights are cast once and reused until the optimizer changes them, see AmaxHistory.cast_weight);
- the GEMM itself, `torch._scaled_mm` (FP8 inputs, BF16 out, FP32 accumulation), which is cuBLASLt's FP8 GEMM on
  CUDA and has CPU and meta kernels in torch 2.13, so real CPU runs compute in FP8 too (torch's flop counter
  counts it as the matmul it is).
Backward: the incoming gradient is cast to e5m2 the same way; dgrad = g @ W and wgrad = g^T @ x run as FP8 GEMMs
on the FP8 copies saved in forward. FP8 GEMMs take only the "TN" layout (cuBLASLt on Hopper; torch checks it on
meta too), so they read transposed FP8 copies (aten.clone of 1-byte tensors), which TE's cast_transpose kernels
write beside the casts.

Where this differs from TE, and why: the scale includes this tensor's own amax (TE's uses the history up to the
previous step), so the first step, which has no history, is scaled like the others rather than at 1.0 (TE's
first step), and no tensor overflows. TE also all-reduces the amaxes once per step over the data- and
tensor-parallel group (a few hundred bytes), not traced here. The LM head and the MoE router stay BF16, as in
Megatron-LM (its output layer is not a TE module) and TE.

    apply_fp8(model)   # after TP/EP/PP; before recomputation wraps the blocks (it re-runs these forwards)
"""
import functools
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from syntorch.errors import UserError
from syntorch.parallel.tensor import ColumnParallelLinear, RowParallelLinear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448 and 57,344
BF16_ONLY = ("lm_head", "router")  # module names whose GEMMs stay in the model dtype
TINY = torch.finfo(torch.float32).tiny
FP8_PEAK = "float8_e4m3fn"  # the peak_tflops entry a device needs for --dtype fp8


def check_fp8(hw) -> None:
    """--dtype fp8 needs FP8 tensor cores: a hardware config without an FP8 peak is refused in one line."""
    if hw is not None and FP8_PEAK not in hw.peak_tflops:
        raise UserError(f"--dtype fp8 needs FP8 tensor cores, which {hw.name} does not have (no {FP8_PEAK} in its "
                        "peak_tflops); use --hw_config h100-sxm or h200-sxm, or --dtype bf16")


class AmaxHistory:
    """One module's per-tensor scaling state: the running amax of its input, weight and gradient (FP32 scalars),
    and the weight's FP8 copy while the weight is unchanged."""

    def __init__(self, device):
        # from the least normal FP32 up, so a scale is never infinite (an all-zero tensor casts to zeros)
        self.amax = {role: torch.full((), TINY, device=device) for role in ("input", "weight", "grad")}
        self.weight_fp8 = None  # (weakref to the weight, its version, FP8 copy, scale_inv)

    def cast_weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight in e4m3, cast again only when it changed (the optimizer's in-place update bumps its
        version): Megatron-LM passes TE `is_first_microbatch`, so the later micro-batches of a step reuse the
        first one's cast, and inference casts each weight once."""
        cached = self.weight_fp8
        if cached is None or cached[0]() is not weight or cached[1] != weight._version:
            self.weight_fp8 = (weakref.ref(weight), weight._version, *self.cast(weight, "weight", E4M3))
        return self.weight_fp8[2:]

    def cast(self, x: torch.Tensor, role: str, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(x in `fp8`, its scale_inv): amax, history, scale, cast (module docstring)."""
        amax = torch.linalg.vector_norm(x.detach(), float("inf"), dtype=torch.float32)
        self.amax[role] = torch.maximum(self.amax[role], amax)
        scale_inv = self.amax[role] / FP8_MAX[fp8]
        return (x.detach() / scale_inv).to(fp8), scale_inv


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major, as FP8 GEMMs read their second operand (TE's transposed copy)."""
    return t.t().contiguous().t()


class Fp8Linear(torch.autograd.Function):
    """y = x @ W^T with both in e4m3; backward's two GEMMs take the gradient in e5m2."""

    @staticmethod
    def forward(ctx, x, weight, history):
        x8, x_inv = history.cast(x.reshape(-1, x.shape[-1]), "input", E4M3)
        w8, w_inv = history.cast_weight(weight)
        y = torch._scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype)
        ctx.save_for_backward(x8, w8, x_inv, w_inv)
        ctx.history, ctx.x_shape, ctx.w_dtype = history, x.shape, weight.dtype
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        x8, w8, x_inv, w_inv = ctx.saved_tensors
        g8, g_inv = ctx.history.cast(grad.reshape(-1, grad.shape[-1]), "grad", E5M2)
        dx = torch._scaled_mm(g8, _col_major(w8), scale_a=g_inv, scale_b=w_inv, out_dtype=grad.dtype)
        dw = torch._scaled_mm(g8.t().contiguous(), _col_major(x8), scale_a=g_inv, scale_b=x_inv, out_dtype=ctx.w_dtype)
        return dx.view(ctx.x_shape), dw, None


class _Fp8Linears(TorchFunctionMode):
    """While one module's forward runs: its F.linear in FP8 (the bias added after, a GEMM epilogue in TE)."""

    def __init__(self, history: AmaxHistory):
        super().__init__()
        self.history = history

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x, weight, bias = (list(args) + [kwargs.get("bias")])[:3]
        y = Fp8Linear.apply(x, weight, self.history)
        return y if bias is None else y + bias


def _forward(history: "AmaxHistory", original: weakref.WeakMethod, *args, **kwargs):
    with _Fp8Linears(history):
        return original()(*args, **kwargs)


def _fp8_module(name: str, module: nn.Module) -> bool:
    linear = isinstance(module, (nn.Linear, ColumnParallelLinear, RowParallelLinear))
    return linear and name.rpartition(".")[2] not in BF16_ONLY


def apply_fp8(model: nn.Module, cast_weights: bool = False) -> list[str]:
    """Make every Linear (and TP-parallel Linear) but the LM head and the router run its GEMMs in FP8, in place:
    its forward runs under a mode that sends its F.linear to Fp8Linear. `cast_weights` (inference): cast each
    weight now, as an FP8 inference engine loads FP8 weights, so no traced step pays for it. Returns the modules
    changed."""
    done = []
    for name, module in model.named_modules():
        if _fp8_module(name, module):
            module.fp8_history = AmaxHistory(module.weight.device)
            # the module's forward held weakly: set on the module, a strong one is a cycle that keeps every
            # Linear of a search task's probe until a full collection
            module.forward = functools.partial(_forward, module.fp8_history, weakref.WeakMethod(module.forward))
            if cast_weights:
                with torch.no_grad():
                    module.fp8_history.cast_weight(module.weight)
            done.append(name)
    return done
