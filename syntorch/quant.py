"""INT8 weight-only quantization (FasterTransformer's `int8_mode=1`), applied to a finished model as TP is.

Each Linear weight [out, in] becomes int8 with one scale per output channel (symmetric: scale = max|w| / 127,
q = round(w / scale)), and the product dequantizes inside the matmul: y = (x @ q^T) * scale + b, as one aten op,
`_weight_int8pack_mm`, which reads the int8 bytes (torch has it for CPU and meta; not for CUDA in 2.13).
Activations stay in the model dtype. The embedding and the LM head keep the model dtype unless asked
(`head=True`): logits are the most sensitive product and, tied, the head is the embedding table.

The model files stay plain: `quantize_int8_weight_only` swaps each weight for an `Int8Weight` parameter, a
tensor subclass whose F.linear runs the int8 product, so nn.Linear and the TP modules (which call
F.linear(x, self.weight, self.bias)) work unchanged. Under TP it runs after sharding: each rank's scales
are those of its own rows (column-parallel) or of its own part of every row (row-parallel), which is what
quantizing that rank's matrix means. On meta it runs too, so traces carry int8 weights and the fused op
(its FLOPs in FLOP_FORMULAS below), and predicted decode time follows the bytes.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from syntorch.errors import UserError
from syntorch.models.router import DeepSeekRouter
from syntorch.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelHead

MODES = ("int8_weight_only",)
HEAD = "lm_head"  # the model attribute every family names its LM head
INT8_MAX = 127


def check_quant(mode: str | None, head: bool, device: str) -> None:
    if mode is None:
        if head:
            raise UserError("--quant_head quantizes the LM head too; it needs --quant int8_weight_only")
        return
    if mode not in MODES:
        raise UserError(f"unknown --quant {mode!r}; choose {', '.join(MODES)}")
    if torch.device(device).type not in ("cpu", "meta"):
        raise UserError(f"--quant {mode} runs on cpu and meta (torch {torch.__version__.split('+')[0]} has its "
                        "int8 weight-only kernel there only); use --device cpu or meta")


class Int8Weight(torch.Tensor):
    """An int8 weight [out, in] with `scale` [out] in the model dtype; F.linear with it is int8_linear."""

    @staticmethod
    def __new__(cls, q: torch.Tensor, scale: torch.Tensor):
        t = torch.Tensor._make_subclass(cls, q, False)
        t.scale = scale
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return int8_linear(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func is torch.Tensor.detach:  # nn.Parameter detaches and needs the same type back
            return Int8Weight(out, args[0].scale)
        return out


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ dequantized weight^T (+ bias), the int8 weight read as it is."""
    with torch._C.DisableTorchFunctionSubclass():
        flat = x.reshape(-1, x.shape[-1]).contiguous()  # the kernel takes [M, in], contiguous
        y = torch.ops.aten._weight_int8pack_mm(flat, weight, weight.scale).view(*x.shape[:-1], -1)
        return y if bias is None else y + bias


def _int8_mm_flops(x: torch.Tensor, w: torch.Tensor, *args, **kwargs) -> int:
    # the product's 2·M·N·K, plus dequantizing each weight once (convert and scale: one multiply)
    (m, k), n = x.shape, w.shape[0]
    return 2 * m * n * k + n * k


# FLOP formulas of the ops above that torch's flop_counter has none for, called as its registry's are (the op's
# arguments, out_val=): the tracer (trace/tracer.py) reads them beside torch's, which stays untouched
FLOP_FORMULAS = {torch.ops.aten._weight_int8pack_mm: _int8_mm_flops}


def quantize_weight(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of w [out, in]; scales computed in fp32, kept in w's dtype."""
    w32 = w.detach().float()
    scale = (w32.abs().amax(dim=1) / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # [out]
    q = torch.round(w32 / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8).contiguous()
    return Int8Weight(q, scale.to(w.dtype))


def _quantizable(name: str, module: nn.Module, head: bool) -> bool:
    is_head = name.rpartition(".")[2] == HEAD or isinstance(module, VocabParallelHead)
    # kept as they are, as vLLM keeps them: DeepSeek's router (scored in FP32) and MLA's kv_b, whose halves the
    # absorbed decode multiplies by directly (vLLM dequantizes it for that form)
    if isinstance(module, DeepSeekRouter) or name.endswith("attn.kv_b"):
        return False
    linear = isinstance(module, (nn.Linear, ColumnParallelLinear, RowParallelLinear, VocabParallelHead))
    weight = getattr(module, "weight", None)
    return (linear and (head or not is_head) and isinstance(weight, torch.Tensor) and weight.is_floating_point()
            and weight.dim() == 2)


def quantize_int8_weight_only(model: nn.Module, head: bool = False) -> list[str]:
    """Swap, in place, every Linear (and TP-parallel Linear) weight for its int8 form; the head only with
    `head`. Its scale becomes a buffer `weight_scale` beside it, so state dicts and traces name it. Returns
    the modules quantized. A tied head, when quantized, stops sharing the embedding's (fp) table."""
    done = []
    for name, module in model.named_modules():
        if _quantizable(name, module, head):
            q = quantize_weight(module.weight)
            module.weight = nn.Parameter(q, requires_grad=False)
            module.register_buffer("weight_scale", q.scale)
            done.append(name)
    return done


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and persistent buffers (scales included), each tensor once."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
