"""HF tensors that hold every expert of a layer (GPT-OSS: mlp.experts.gate_up_proj [E, d, 2 ff] and
down_proj [E, ff, d], stored [in, out], with biases [E, out]) as our per-expert Linear tensors and back.
No file I/O; hf_format.py maps the names."""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Stacked:
    """Our tensor of expert `expert`: row `expert` of the HF tensor `name`, transposed to our [out, in]; with
    `interleaved`, HF's gate and up alternate along the out dim ([..., ::2] gate, [..., 1::2] up) where our fused
    fc1 holds [gate; up]."""
    name: str
    expert: int
    n_experts: int
    interleaved: bool

    def read(self, full) -> torch.Tensor:
        """Ours from the HF tensor (or a safetensors slice, of which only this expert's row is read)."""
        t = full[self.expert:self.expert + 1][0]  # [in, out] or a bias [out]
        if self.interleaved:
            t = torch.cat((t[..., 0::2], t[..., 1::2]), -1)
        return (t.t() if t.dim() == 2 else t).contiguous()

    def write(self, ours: torch.Tensor) -> torch.Tensor:
        """HF's row of this expert from ours (the inverse of read)."""
        t = ours.t() if ours.dim() == 2 else ours
        if self.interleaved:
            t = torch.stack(t.chunk(2, -1), -1).flatten(-2)
        return t


def stack_experts(rows: dict[str, dict[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """HF name -> its [E, ...] tensor, from each expert's row (Stacked.write) keyed by expert index."""
    return {name: torch.stack([by_expert[e] for e in range(len(by_expert))]).contiguous()
            for name, by_expert in rows.items()}


class StackedView:
    """A Stacked tensor read only when indexed, for checkpoints.LazyTensor (a TP or EP rank's slices)."""

    def __init__(self, full, source: Stacked):
        self.full, self.source = full, source
        shape = tuple(full.get_shape() if hasattr(full, "get_shape") else full.shape)[1:]
        self.shape = shape[::-1]  # [out, in], or the bias's [out]

    def __getitem__(self, key) -> torch.Tensor:
        return self.source.read(self.full)[key]
