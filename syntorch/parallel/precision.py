"""Mixed-precision training as Megatron-LM runs it (Micikevicius et al. 2018): the model computes in fp16 or
bf16, the optimizer updates FP32 master copies of what this rank updates (its parameters, or its ZeRO shard)
and the updated masters are cast back into the model's weights.

Gradients accumulate and are reduced in the model dtype. That is Megatron's default for fp16
(`accumulate_allreduce_grads_in_fp32` off); for bf16 Megatron turns that flag on by default (fp32 gradient
buffers: bf16's 8-bit mantissa loses small accumulated gradients). `--grad_reduce_dtype fp32` (data.py,
fsdp.py) runs the DP reduction in FP32; the accumulation over micro-batches stays in the model dtype, and
gradients become FP32 for good only when handed to the masters.

fp16 scales the loss (dynamic loss scaling, Megatron's DynamicGradScaler defaults: 2**32 to start, halved on
a step whose gradients are not finite, which is then skipped, after `hysteresis` such steps; doubled after
`growth_interval` good steps); bf16 has fp32's range and needs no scaling.
"""
from dataclasses import dataclass, field

import torch
import torch.nn as nn


@dataclass
class LossScaler:
    scale: float = 2.0 ** 32
    min_scale: float = 1.0
    growth_interval: int = 1000
    hysteresis: int = 2
    good_steps: int = 0
    bad_steps: int = 0

    def update(self, finite: bool) -> None:
        if finite:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale, self.good_steps, self.bad_steps = self.scale * 2, 0, 0
            return
        self.good_steps, self.bad_steps = 0, self.bad_steps + 1
        if self.bad_steps >= self.hysteresis:
            self.scale, self.bad_steps = max(self.scale / 2, self.min_scale), 0


@dataclass
class MixedPrecision:
    """FP32 masters of `params` (what the optimizer would update) and, for fp16, the loss scaler."""
    params: list[nn.Parameter]
    masters: list[nn.Parameter] = field(default_factory=list)
    scaler: LossScaler | None = None

    @classmethod
    def of(cls, params: list[nn.Parameter], dtype: torch.dtype) -> "MixedPrecision | None":
        """None in FP32 (nothing to do)."""
        if dtype == torch.float32:
            return None
        masters = [nn.Parameter(p.detach().float()) for p in params]
        return cls(list(params), masters, LossScaler() if dtype == torch.float16 else None)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler else loss

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, clip: torch.Tensor | None = None) -> bool:
        """Gradients to the masters in FP32 (unscaled, then multiplied by the `clip` factor when given), the
        optimizer's step on them unless a gradient is not finite (fp16), the masters cast back into the
        model's weights. Returns whether the step was taken."""
        # one multi-tensor cast into FP32 buffers (not a kernel per parameter)
        grads = [torch.empty_like(m) for m in self.masters]
        torch._foreach_copy_(grads, [p.grad for p in self.params])
        if self.scaler:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
            found = torch.stack([g.isfinite().all() for g in grads]).all()
            finite = found.device.type == "meta" or bool(found)  # a symbolic step is a taken one
            self.scaler.update(finite)
            if not finite:
                return False
        if clip is not None:
            torch._foreach_mul_(grads, clip)
        for master, grad in zip(self.masters, grads):
            master.grad = grad
        optimizer.step()
        torch._foreach_copy_(self.params, self.masters)
        return True
