"""Meta kernels memoized: on `meta` an op's result is only shapes, strides and dtypes, a function of its
arguments' shapes, strides, dtypes and other values. Most meta kernels are Python (torch._refs) and cost far
more than recording the op, and a training step runs the same ones with the same shapes in every layer and
micro-batch, so each is run once and its results rebuilt as fresh meta tensors afterwards.

Only functional ops are memoized: aten ops that neither alias nor write any argument and return new tensors.
Views, in-place ops and collectives run as they are. Enter `MetaCache()` before the Tracer, so the tracer's
dispatch mode sits above it: the tracer sees every op and its (rebuilt) outputs as before. (The tracer takes a
MetaCache that is the only mode off the stack while it records and calls its `run` itself: a dispatch into a
Python mode costs more than most ops, and each op then takes one instead of two.)
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from syntorch.trace.values import flat_tensors

# argument values a result may depend on and that hash by value (their type is part of the key: 1 == True)
_VALUES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_META = torch.device("meta")  # (a device given as text is parsed at every call)
_UNSHAPED = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


_FUNCTIONAL: dict[int, tuple] = {}  # id(func) -> (func, is functional): an OpOverload hashes in Python


def _functional(func) -> bool:
    found = _FUNCTIONAL.get(id(func))
    if found is None or found[0] is not func:
        found = _FUNCTIONAL[id(func)] = (func, _is_functional(func))
    return found[1]


def _is_functional(func) -> bool:
    schema = func._schema
    return (func.namespace == "aten" and bool(schema.returns)
            and all(str(r.type) == "Tensor" and r.alias_info is None for r in schema.returns)
            and all(a.alias_info is None for a in schema.arguments)
            and not any(tag in func.tags for tag in _UNSHAPED))


def _key(values) -> tuple:
    """A hashable key of a list or tuple of argument values (its type, then each value's; nested lists and
    tuples in turn)."""
    key = [type(values)]
    for value in values:
        if isinstance(value, torch.Tensor):
            # (is_meta first: building a device object costs more than the rest of the key)
            key.append((type(value), value.shape, value.stride(), value.storage_offset(), value.dtype,
                        "meta" if value.is_meta else value.device.type))
        elif isinstance(value, (list, tuple)):
            key.append(_key(value))
        elif isinstance(value, _VALUES):
            key.append((type(value), value))
        else:
            raise TypeError(f"not memoized: {type(value)}")
    return tuple(key)


def _fresh_meta(out, args) -> bool:
    """Results a rebuild reproduces: meta tensors at offset 0 of storages of their own (none an argument's)."""
    storages = {t.untyped_storage()._cdata for t in out}
    taken = {t.untyped_storage()._cdata for t in flat_tensors(args)}
    return (len(storages) == len(out) and not storages & taken
            and all(t.device.type == "meta" and t.storage_offset() == 0 for t in out))


class MetaCache(TorchDispatchMode):
    # shared by every instance: a result depends on the key alone, so runs in one process reuse each other's
    results: dict = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No torch._dynamo.disable wrapper around __torch_dispatch__ (two Python calls an op, with nodynamo's):
        nothing compiles on meta."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.run(func, args, kwargs or {})

    def run(self, func, args, kwargs: dict):
        """func(*args, **kwargs), its results rebuilt from the cache when they can be."""
        if not _functional(func):
            return func(*args, **kwargs)
        try:
            key = (func, _key(args), _key(sorted(kwargs.items())) if kwargs else ())
        except TypeError:
            return func(*args, **kwargs)
        found = self.results.get(key)
        if found is None:
            out = func(*args, **kwargs)
            outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
            self.results[key] = (isinstance(out, torch.Tensor), [(t.shape, t.stride(), t.dtype) for t in outs]
                                 ) if _fresh_meta(outs, (args, list(kwargs.values()))) else False
            return out
        if found is False:  # results this cache cannot rebuild (not on meta, or sharing storage)
            return func(*args, **kwargs)
        single, metas = found
        outs = [torch.empty_strided(shape, stride, dtype=dtype, device=_META) for shape, stride, dtype in metas]
        return outs[0] if single else tuple(outs)


def only_mode() -> MetaCache | None:
    """The MetaCache on the dispatch mode stack, when it is the only mode there."""
    if torch._C._len_torch_dispatch_stack() == 1:
        mode = torch.utils._python_dispatch._get_current_dispatch_mode()
        return mode if isinstance(mode, MetaCache) else None
    return None
