"""What the Tracer needs to know of an aten op to record it (its name, tensor arguments, FLOP formula), read
once per op and kept: an OpOverload's attributes and schema are slow to read (and hashing one runs Python),
and a training step records 10^4 ops."""
from typing import NamedTuple

import torch
from torch.utils.flop_counter import flop_registry, shape_wrapper

from syntorch.quant import FLOP_FORMULAS


class AtenOp(NamedTuple):
    name: str  # e.g. aten.mm
    is_view: bool
    collective: tuple | None  # a c10d op's (name, default) of each argument (collectives.py tells what it is)
    arguments: tuple  # (position, name, written) of each argument that may hold tensors
    flops: tuple | None  # its FLOP formula (flop_counter's, or quant's) and whether it takes shapes (_flop_formula)
    decomposes: bool  # no formula of flop_counter's: recorded as the ops it decomposes into, if it does


_ATEN_OPS: dict[int, tuple] = {}  # id(func) -> (func, AtenOp); OpOverloads live as long as torch


def aten_op(func) -> AtenOp:
    found = _ATEN_OPS.get(id(func))
    if found is None or found[0] is not func:
        packet = func._overloadpacket
        found = _ATEN_OPS[id(func)] = (func, AtenOp(
            f"{func.namespace}.{packet.__name__}", func.is_view, _collective_arguments(func),
            _tensor_arguments(func), _flop_formula(packet), packet not in flop_registry))
    return found[1]


def _collective_arguments(func) -> tuple | None:
    if func.namespace not in ("c10d", "_c10d_functional"):
        return None
    return tuple((a.name, a.default_value) for a in func._schema.arguments)


_SHAPE_WRAPPER = shape_wrapper(lambda: 0).__code__  # flop_counter's wrapper of formulas taking shapes


def _flop_formula(packet):
    """The FLOP formula of an op: (formula taking shapes, True) for flop_counter's shape-wrapped ones, whose
    wrapper maps tensors to shapes with pytree (~30 us an op, op_flops does it in a loop); else (formula, False)."""
    formula = flop_registry.get(packet) or FLOP_FORMULAS.get(packet)
    if formula is None:
        return None
    if getattr(formula, "__code__", None) is _SHAPE_WRAPPER:
        return formula.__wrapped__, True
    return formula, False


def op_flops(formula: tuple, args, kwargs, out) -> int:
    """What flop_counter's formula counts for the op (shape_wrapper's call: each tensor replaced by its shape)."""
    fn, takes_shapes = formula
    if not takes_shapes:
        return fn(*args, **kwargs, out_val=out)
    return fn(*_shapes(args), out_shape=_shapes(out), **{k: _shapes(v) for k, v in kwargs.items()})


def _shapes(value):
    """value with its tensors replaced by their shapes, in lists and tuples (the containers aten ops take and
    return), as pytree's map does."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if type(value) in (list, tuple):
        return type(value)(map(_shapes, value))
    return value


def _tensor_arguments(func) -> tuple:
    """(position, name, written) of each argument of func that may hold tensors."""
    found = []
    for i, arg in enumerate(func._schema.arguments):
        if "Tensor" in str(arg.type):
            found.append((i, arg.name, arg.alias_info is not None and arg.alias_info.is_write))
    return tuple(found)


def schema_inputs(arguments: tuple, args, kwargs):
    """Tensor arguments in schema order (lists flattened), and those the op writes (`Tensor(a!)`)."""
    inputs, written = [], []
    for i, name, is_written in arguments:
        value = args[i] if i < len(args) else kwargs.get(name)
        tensors = [value] if isinstance(value, torch.Tensor) else [
            t for t in value if isinstance(t, torch.Tensor)] if isinstance(value, (list, tuple)) else []
        inputs.extend(tensors)
        if is_written:
            written.extend(tensors)
    return inputs, written
