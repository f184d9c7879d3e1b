"""Keeps torch's compiler stack (torch._dynamo, ~1.2 s to import) out of runs that compile nothing.

torch wraps many Python functions in `torch._disable_dynamo`: every Python meta kernel with type promotion
(add, sub, where, cat, gelu, ...: on `meta` these replace the C++ kernels), torch.utils.checkpoint, and
each TorchDispatchMode's __torch_dispatch__. On its first call the wrapper imports torch._dynamo to build
`torch._dynamo.disable(fn)`, then caches that on `fn.__dynamo_disable`.
While torch._dynamo is not imported nothing can be compiling (torch.compile imports it), so there is
nothing to disable: `skip_dynamo_until_loaded` puts a stand-in in that cache which calls `fn` as is until
torch._dynamo is loaded, and the real disabled function from then on. What runs is unchanged either way.
torch.optim's step wrapper imports torch._dynamo itself, outside this cache, for graph breaks that only a
compiled step needs: `plain_step` gives an optimizer the step without its wrappers.
"""
import functools
import gc
import inspect
import sys
import weakref
from types import FunctionType

import torch


class _DisableOnceLoaded:
    """`torch._dynamo.disable(fn, recursive, wrapping=False)`, built only once torch._dynamo is imported."""

    def __init__(self, fn, recursive: bool):
        self.fn, self.recursive, self.disabled = fn, recursive, None

    def __call__(self, *args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return self.fn(*args, **kwargs)
        if self.disabled is None:
            import torch._dynamo
            self.disabled = torch._dynamo.disable(self.fn, self.recursive, wrapping=False)
        return self.disabled(*args, **kwargs)


def _wrapper_code():
    """The code object of torch._disable_dynamo's wrapper (its closure holds `fn` and `recursive`)."""
    return torch._disable_dynamo(lambda: None).__code__


@functools.cache  # once per process: torch defines its wrappers when it is imported
def skip_dynamo_until_loaded():
    """Gives every `torch._disable_dynamo` wrapper alive now the stand-in above (those defined later, e.g. by
    a dispatch mode class created afterwards, still import torch._dynamo on first call). About 50 ms: the
    wrappers are found among all objects the garbage collector tracks."""
    code = _wrapper_code()
    for wrapper in gc.get_referrers(code):
        if not isinstance(wrapper, FunctionType):
            continue
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in wrapper.__closure__)))
        fn = cells["fn"]
        if getattr(fn, "__dynamo_disable", None) is None:
            setattr(fn, "__dynamo_disable", _DisableOnceLoaded(fn, cells["recursive"]))


def plain_step(optimizer: torch.optim.Optimizer):
    """`optimizer.step` as torch.optim's wrappers run it -- inside the profiler's range the step hooks would
    run in (none are registered), without gradients -- but without the graph breaks that only a compiled step
    needs, so that its first call imports no torch._dynamo (~0.75 s and ~70 MB). For steps that nothing
    compiles (a symbolic trace): the same ops."""
    step = inspect.unwrap(type(optimizer).step)
    name = f"Optimizer.step#{type(optimizer).__name__}.step"
    owner = weakref.ref(optimizer)  # set as optimizer.step: held strongly, the pair is a cycle

    def plain(closure=None):
        with torch.autograd.profiler.record_function(name), torch.no_grad():
            return step(owner(), closure)
    return plain
