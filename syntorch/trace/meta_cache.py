"""Meta kernels memoized: on `meta` an op's result is only shapes, strides and dtypes, a function of its
arguments' shapes, strides, dtypes and other values. Most meta kernels are Python (torch._refs) and cost far
more than recording the op, and a training step runs the same ones with the same shapes in every layer and
micro-batch, so each is run once and its results rebuilt as fresh meta tensors afterwards.

Functional ops are memoized: aten ops that neither alias nor write any argument and return new tensors (or a list
of them, as foreach ops do). So are in-place ops (they write arguments and return one of them, or nothing) that
leave every argument's shape, strides, offset, dtype and storage as they were: on meta they only check their
arguments, and the Python checks of an optimizer step's foreach ops over every parameter cost ~10% of a probe.
Views and collectives run as they are. Enter `MetaCache()` before the Tracer, so the tracer's dispatch mode sits
above it: the tracer sees every op and its (rebuilt) outputs as before. (The tracer takes a MetaCache that is the
only mode off the stack while it records and calls its `run` itself: a dispatch into a Python mode costs more
than most ops, and each op then takes one instead of two.)
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from syntorch.trace.values import flat_tensors

# argument values a result may depend on and that hash by value (their type is part of the key: 1 == True)
_VALUES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_META = torch.device("meta")  # (a device given as text is parsed at every call)
_UNSHAPED = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


# id(func) -> (func, its kind, its results by arguments' key), shared by every MetaCache: a result depends on the
# key alone, so runs in one process reuse each other's (by id: an OpOverload hashes in Python)
_OPS: dict[int, tuple] = {}
_COMPOSITES: dict[tuple, list | bool] = {}  # memo_key -> what `remember` kept


def _op(func) -> tuple:
    """(func, kind, results) of func: kind "functional", "in_place" (both memoized, see above) or None (run as it
    is)."""
    found = _OPS.get(id(func))
    if found is None or found[0] is not func:
        schema = func._schema
        kind = None
        if func.namespace == "aten" and not any(tag in func.tags for tag in _UNSHAPED):
            if _is_functional(schema):
                kind = "functional"
            elif _is_in_place(schema):
                kind = "in_place"
        found = _OPS[id(func)] = (func, kind, {})
    return found


def _is_functional(schema) -> bool:
    """Returns new tensors (or one list of them, as foreach ops do) and aliases no argument."""
    return (bool(schema.returns) and all(a.alias_info is None for a in schema.arguments)
            and all(str(r.type) in ("Tensor", "List[Tensor]") and r.alias_info is None for r in schema.returns))


def _is_in_place(schema) -> bool:
    """Writes its aliased arguments (none is only a view) and returns one of them, or nothing."""
    aliased = [a for a in schema.arguments if a.alias_info is not None]
    return (bool(aliased) and all(a.alias_info.is_write for a in aliased) and len(schema.returns) <= 1
            and all(str(r.type) == "Tensor" and r.alias_info is not None and r.alias_info.is_write
                    for r in schema.returns))


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


def _layouts(args, kwargs: dict) -> list:
    """What an in-place op must leave as it was: each tensor argument's shape, strides, offset, dtype, storage."""
    return [(t.shape, t.stride(), t.storage_offset(), t.dtype, t.untyped_storage()._cdata)
            for t in flat_tensors((args, list(kwargs.values())))]


def _returned(out, args, kwargs: dict) -> tuple | bool:
    """Where an in-place op's result is among its arguments: () for none, (position,) or (name,); False if
    it is not one of them."""
    if out is None:
        return ()
    where = [i for i, a in enumerate(args) if a is out] or [k for k, v in kwargs.items() if v is out]
    return (where[0],) if where else False


def _fresh_meta(out, args) -> bool:
    """Results a rebuild reproduces: meta tensors at offset 0 of storages of their own (none an argument's)."""
    storages = {t.untyped_storage()._cdata for t in out}
    taken = {t.untyped_storage()._cdata for t in flat_tensors(args)}
    return (len(storages) == len(out) and not storages & taken
            and all(t.device.type == "meta" and t.storage_offset() == 0 for t in out))


class MetaCache(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No torch._dynamo.disable wrapper around __torch_dispatch__ (two Python calls an op, with nodynamo's):
        nothing compiles on meta."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.run(func, args, kwargs or {})

    def run(self, func, args, kwargs: dict):
        """func(*args, **kwargs), its results rebuilt from the cache when they can be."""
        _, kind, results = _op(func)
        if kind is None:
            return func(*args, **kwargs)
        try:
            key = (_key(args), _key(sorted(kwargs.items())) if kwargs else ())
        except TypeError:
            return func(*args, **kwargs)
        found = results.get(key)
        if found is None:
            out, results[key] = self._first(kind, func, args, kwargs)
            return out
        if found is False:  # results this cache cannot rebuild (not on meta, sharing storage, changed arguments)
            return func(*args, **kwargs)
        if kind == "in_place":  # checked the same arguments before: the argument it returns, if any
            return None if not found else args[found[0]] if isinstance(found[0], int) else kwargs[found[0]]
        container, metas = found
        outs = _rebuild(metas)
        return outs[0] if container is torch.Tensor else container(outs)

    def _first(self, kind: str, func, args, kwargs: dict) -> tuple:
        """func run, and what to remember of its results."""
        if kind == "in_place":
            before = _layouts(args, kwargs)
            out = func(*args, **kwargs)
            on_meta = all(t.device.type == "meta" for t in flat_tensors((args, list(kwargs.values()))))
            return out, _returned(out, args, kwargs) if on_meta and _layouts(args, kwargs) == before else False
        out = func(*args, **kwargs)
        container = torch.Tensor if isinstance(out, torch.Tensor) else type(out)  # or a tuple, or a list
        outs = (out,) if container is torch.Tensor else tuple(out)
        return out, (container, [(t.shape, t.stride(), t.dtype) for t in outs]
                     ) if _fresh_meta(outs, (args, list(kwargs.values()))) else False


def memo_key(*values) -> tuple | None:
    """A key for `remember` and `rebuilt` of what a composite call's results depend on (tensors, lists and plain
    values), or None if they are not all on meta or are not plain values (then it is run as it is)."""
    try:
        key = _key(values)
    except TypeError:
        return None
    return key if all(t.device.type == "meta" for t in flat_tensors(values)) else None


def remember(key: tuple | None, outs: list, inputs) -> None:
    """Keep the layouts of a composite call's results under `key` (memo_key), as MetaCache keeps an op's: for a
    call whose parts would each be dispatched and memoized on their own (attention.py's sdpa, ~60 ops)."""
    if key is not None and key not in _COMPOSITES:
        _COMPOSITES[key] = [(t.shape, t.stride(), t.dtype) for t in outs] if _fresh_meta(outs, inputs) else False


def rebuilt(key: tuple | None) -> list | None:
    """Fresh meta tensors laid out as the results `remember` kept under `key`, or None."""
    found = _COMPOSITES.get(key) if key is not None else None
    return _rebuild(found) if found else None


def _rebuild(metas: list) -> list:
    return [torch.empty_strided(shape, stride, dtype=dtype, device=_META) for shape, stride, dtype in metas]


def only_mode() -> MetaCache | None:
    """The MetaCache on the dispatch mode stack, when it is the only mode there."""
    if torch._C._len_torch_dispatch_stack() == 1:
        mode = torch.utils._python_dispatch._get_current_dispatch_mode()
        return mode if isinstance(mode, MetaCache) else None
    return None
