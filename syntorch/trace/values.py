"""The tensors in an op's arguments or results (a faster tree_flatten for what aten ops take and return)."""
import torch


def flat_tensors(value, keep_others: bool = False) -> list:
    """The tensors in a (nested) list or tuple, in order; with `keep_others`, None stands for each item that
    is no tensor, so an op's outputs keep their positions."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in flat_tensors(item, keep_others)]
    return [None] if keep_others else []
