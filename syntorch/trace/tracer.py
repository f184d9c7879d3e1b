"""The Tracer: records every aten op and collective that runs inside it into a TraceGraph.

    with Tracer(model, meta={"model": "gpt2"}) as tracer:
        with tracer.phase("prefill"):
            model(x)
    graph = tracer.graph

Three pieces cooperate (DESIGN.md, facts):
- forward pre/post hooks on every module keep a stack of module paths (the forward attribution);
- a TorchFunctionMode tags each new autograd node with the module it was created in, so a backward op is
  attributed through `torch._C._current_autograd_node()` -- exact even when modules share an input, where
  torch's ModuleTracker merges them; it also records scaled_dot_product_attention as one fused op, so the
  op structure does not depend on the device (on meta sdpa decomposes into the math path), with the FLOPs a
  flash kernel spends under a causal mask (attention.py);
- a TorchDispatchMode records each aten op (after autograd) with FLOPs from torch.utils.flop_counter's
  formula registry, and each c10d collective with its group, reduce op and peers (collectives.py); on meta a
  c10d op is not called: its meta kernel's result is made (collectives.meta_result).
"""
import contextlib
import functools
import time
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from syntorch.trace import meta_cache
from syntorch.trace.aten_ops import AtenOp, aten_op, op_flops, schema_inputs
from syntorch.trace.attention import SDPA, fused_attention  # noqa: F401 (SDPA: cost.py imports it from here)
from syntorch.trace.collectives import collective_call, meta_result
from syntorch.trace.graph import TraceGraph, no_gc, op_attrs
from syntorch.trace.replicate import LayerCall
from syntorch.trace.values import flat_tensors


_UNWRITTEN = (0, None)  # a storage's (writes, last writer) before any recorded write
_UNNAMED = ("", False)  # (name, is_param) of a tensor that is no parameter or buffer
_storage_id = torch._C._storage_id
# Phases our function mode has nothing to do in, run without it (~20% fewer Python calls of a training probe's
# torch calls): autograd's backward keeps no function mode (a recomputed forward enters it again itself:
# parallel/recompute.py), the code around it and the optimizer's make no autograd node a later backward runs
# and call no attention. Same graphs (tests/trace/test_tracer.py).
QUIET_PHASES = ("backward", "optimizer")


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (str() of a dtype builds the text each time)."""
    return str(dtype).removeprefix("torch.")


class Tracer:
    """Context manager recording what runs inside it. `default_phase=None` records only inside `phase()`;
    `time_ops` stores each op's measured wall time as `duration_us` (meaningful for CPU runs only: CUDA
    kernels run asynchronously and meta ops do no work). `first_layer_only` records the first transformer
    layer and runs the others unrecorded, for replicate.py to copy (a real run's values need every layer)."""

    def __init__(self, model: torch.nn.Module | None = None, rank: int = 0, world_size: int = 1,
                 meta: dict | None = None, default_phase: str | None = "forward", time_ops: bool = False,
                 first_layer_only: bool = False):
        self.time_ops = time_ops
        self.first_layer_only = first_layer_only
        self.graph = TraceGraph(**{**(meta or {}), "rank": rank, "world_size": world_size})
        self.model = model
        self.modules = [""]  # stack of module paths, innermost last
        self.phases = [default_phase]
        self.paused = 0  # > 0 while a fused op runs its parts
        # id(tensor) -> (weak ref, node, ...: see tensor_node); a plain dict with weak refs is several times
        # faster than torch's WeakIdKeyDictionary, and lookups are the hot path
        self.tensors: dict[int, tuple] = {}
        self.writes: dict[int, tuple[int, int]] = {}  # storage key -> (number of writes, last writing op)
        self.names: dict[int, tuple[str, bool]] = {}  # id(parameter or buffer) -> (name, is_param); they outlive the trace
        self.layer_calls: list[LayerCall] = []  # each forward call of a transformer layer, for replicate.py
        self.unrecorded: list[contextlib.ExitStack] = []  # per unrecorded layer running now: our modes, popped
        self._exits = contextlib.ExitStack()

    # --- entering and leaving ------------------------------------------------------------------
    def __enter__(self):
        self._exits.enter_context(no_gc())
        self._exits.callback(self._forget_tensors)  # (before the collector runs again)
        if self.model is not None:
            self._watch_modules(self.model)
        cache = meta_cache.only_mode()
        if cache is not None:  # off the stack while we record; our dispatch mode runs ops through it itself
            self._exits.enter_context(torch.utils._python_dispatch._pop_mode_temporarily())
        self._modes = (_FunctionMode(self), _DispatchMode(self, cache))
        for mode in self._modes:
            self._exits.enter_context(mode)
        return self

    def __exit__(self, *exc):
        self._exits.close()
        self._modes = ()  # they point back at the tracer: a cycle, which only the cyclic collector would free
        return False

    def _forget_tensors(self):
        """The tensor table freed when recording ends (the graph and layer calls are what a trace leaves): its
        10^5 objects of a training probe would otherwise be scanned by the cyclic collector's next passes."""
        self.tensors, self.writes = {}, {}

    def _name_tensors(self):
        for name, p in self.model.named_parameters():
            self.names[id(p)] = (name, True)
        for name, b in self.model.named_buffers():  # again per phase: KV caches are attached late
            self.names[id(b)] = (name, False)

    def _watch_modules(self, model: torch.nn.Module):
        self._name_tensors()
        layers = list(getattr(model, "layers", {}).values())
        for path, module in model.named_modules():
            index = next((k for k, m in enumerate(layers) if module is m), None)
            skipped = self.first_layer_only and bool(index)
            last = skipped and index == len(layers) - 1
            self._exits.enter_context(module.register_forward_pre_hook(self._enter_module(path, index == 0, skipped)))
            self._exits.enter_context(module.register_forward_hook(self._leave_module(index == 0, skipped, last),
                                                                   always_call=True))

    def _enter_module(self, path: str, is_layer: bool, skipped: bool):
        def hook(_module, args):
            self.modules.append(path)
            if skipped:  # our modes leave the stacks while it runs: even paused, they cost ~5% of every op
                self.paused += 1
                self.unrecorded.append(_modes_popped(self._modes))
            elif is_layer and self._recording() and args and isinstance(args[0], torch.Tensor):
                x = self.tensor_node(args[0])
                self.layer_calls.append(LayerCall(path, len(self.graph), -1, x, -1))
        return hook

    def _leave_module(self, is_layer: bool, skipped: bool, last: bool):
        def hook(_module, _args, out):
            if torch.is_grad_enabled():  # what made the output without a torch function (a checkpoint) is ours
                self.tag_autograd_nodes(out)
            self.modules.pop()
            call = self.layer_calls[-1] if self.layer_calls else None
            if skipped:
                self.unrecorded.pop().close()
                self.paused -= 1
                if last and self._recording() and call is not None and isinstance(out, torch.Tensor):
                    self._alias(out, call.output)  # the stack's output: what replicate.py maps to the last copy
            elif is_layer and call is not None and call.end == -1 and isinstance(out, torch.Tensor):
                call.end, call.output = len(self.graph), self.tensor_node(out)
        return hook

    def _recording(self) -> bool:
        return not self.paused and self.phases[-1] is not None

    @contextlib.contextmanager
    def phase(self, name: str):
        """Label the ops run inside with `name` (prefill, decode[i], forward, optimizer, ...)."""
        if self.model is not None:
            self._name_tensors()
        self.phases.append(name)
        try:
            with _function_mode_popped(self._modes) if name in QUIET_PHASES else contextlib.nullcontext():
                yield
        finally:
            self.phases.pop()

    @contextlib.contextmanager
    def paused_recording(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    # --- where an op belongs -------------------------------------------------------------------
    def where(self) -> tuple[str, str | None]:
        """(module path, phase) of the op running now; backward ops from their autograd node's tag."""
        node = torch._C._current_autograd_node()
        if node is not None:
            return node.metadata.get("module", ""), "backward"
        return self.modules[-1], self.phases[-1]

    def tag_autograd_nodes(self, out):
        """Tag autograd nodes created by the call that just returned `out` with the current module (in
        backward, e.g. a recomputed forward, the module of the backward node running it)."""
        todo = [fn for t in flat_tensors(out) if (fn := t.grad_fn) is not None]
        module = self.where()[0] if todo else None
        while todo:
            node = todo.pop()
            if node is None or "module" in node.metadata:
                continue
            node.metadata["module"] = module
            todo.extend(next_node for next_node, _ in node.next_functions)

    # --- tensors -------------------------------------------------------------------------------
    # self.tensors: id(tensor) -> (weak ref, node, storage key, storage writes when the node was made, node's version)
    def tensor_node(self, t: torch.Tensor) -> int:
        """The node holding t's current value: new at first sight, a new version after an aliased write."""
        key = _storage_key(t)
        writes, writer = self.writes.get(key, _UNWRITTEN)
        entry = self.tensors.get(id(t))  # (_entry, inline: the hot path)
        if entry is None or entry[0]() is not t:
            return self._add_tensor(t, key, writes, 0)
        if entry[3] == writes:
            return entry[1]
        # a write through another alias (a view, a KV-cache slice) changed the storage since: -1, written
        # through an alias, not a returned output
        return self._add_tensor(t, key, writes, entry[4] + 1, writer, -1)

    def output_node(self, t: torch.Tensor, op: int, arg: int, wrote: bool) -> int:
        """A new node for an op's output: a new version if the op wrote t in place (which every alias of
        its storage then sees), else a fresh tensor or a view."""
        return self._output(t, self._entry(t), op, arg, wrote)

    def _output(self, t: torch.Tensor, entry: tuple | None, op: int, arg: int, wrote: bool) -> int:
        key = _storage_key(t)
        writes = self.writes.get(key, _UNWRITTEN)[0]
        if wrote:
            writes += 1
            self.writes[key] = (writes, op)
        return self._add_tensor(t, key, writes, entry[4] + 1 if entry else 0, op, arg)

    def _alias(self, t: torch.Tensor, node: int) -> None:
        """Let t's current value be `node` (a value made while recording was paused)."""
        key = _storage_key(t)
        self.tensors[id(t)] = (weakref.ref(t), node, key, self.writes.get(key, _UNWRITTEN)[0],
                               self.graph.node_attrs[node]["version"])

    def _entry(self, t: torch.Tensor) -> tuple | None:
        """t's entry in self.tensors if seen before (an id reused by a new tensor is not seen)."""
        entry = self.tensors.get(id(t))
        return entry if entry is not None and entry[0]() is t else None

    def _add_tensor(self, t: torch.Tensor, key: int, writes: int, version: int, writer: int | None = None,
                    arg: int = 0) -> int:
        """A node for t's value, written by op `writer` as its output `arg` (None: by no recorded op)."""
        name, is_param = self.names.get(id(t), _UNNAMED)
        node = self.graph.add_traced_tensor(name, list(t.shape), dtype_name(t.dtype), t.nbytes, is_param,
                                            "meta" if t.is_meta else t.device.type, version, writer, arg)
        self.tensors[id(t)] = (weakref.ref(t), node, key, writes, version)
        return node

    # --- ops -----------------------------------------------------------------------------------
    def timed(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) and its wall time in microseconds (None unless time_ops)."""
        if not self.time_ops:
            return fn(*args, **kwargs), None
        begin = time.perf_counter()
        out = fn(*args, **kwargs)
        return out, (time.perf_counter() - begin) * 1e6

    def record_op(self, name: str, inputs: list, outputs: list, flops: int, is_view: bool = False,
                  written: list | None = None, duration_us: float | None = None, **attrs) -> int | None:
        """inputs/outputs: tensors (or None) in argument order; `written`: inputs the op mutated in place;
        `attrs`: more attributes of the op node."""
        module, phase = self.where()
        if phase is None:
            return None
        in_nodes = [self.tensor_node(t) if t is not None else None for t in inputs]
        if is_view:  # views move no data
            data = op_attrs(name, module, phase, flops, 0, 0, True)
        else:
            data = op_attrs(name, module, phase, flops, _unique_bytes(inputs),
                            _unique_bytes([*outputs, *written] if written else outputs), False)
        if duration_us is not None:
            data["duration_us"] = duration_us
        if attrs:
            data.update(attrs)
        op = self.graph.add_node_data(data, in_nodes)
        written_ids = {id(t) for t in written} if written else set()
        for arg, t in enumerate(outputs):
            if t is not None:
                entry = self._entry(t)
                self._output(t, entry, op, arg, entry is not None or id(t) in written_ids)
                written_ids.discard(id(t))
        for t in written or ():
            if id(t) in written_ids:  # mutated but not returned, e.g. ops returning None
                self.output_node(t, op, -1, wrote=True)
        return op

    def record_aten(self, func, op: AtenOp, args, kwargs, out, duration_us=None):
        if op.collective is not None:
            call = collective_call(func, op.collective, args, kwargs, out)
            if call is not None:
                return self.record_collective(call)
        inputs, written = schema_inputs(op.arguments, args, kwargs)
        outputs = [out] if isinstance(out, torch.Tensor) else flat_tensors(out, keep_others=True)
        flops = op_flops(op.flops, args, kwargs, out) if op.flops else 0
        self.record_op(op.name, inputs, outputs, flops, is_view=op.is_view, written=written, duration_us=duration_us)

    def record_collective(self, call):
        module, phase = self.where()
        if phase is None:
            return
        inputs = [self.tensor_node(t) for t in call.inputs]
        node = self.graph.add_collective(call.collective, inputs, group=call.group, nbytes=call.nbytes,
                                         reduce_op=call.reduce_op, src=call.src, dst=call.dst, tag=call.tag,
                                         module=module, **call.peer_bytes, phase=phase, name=call.name)
        for arg, t in enumerate(call.outputs):
            self.output_node(t, node, arg, wrote=True)


class _DispatchMode(TorchDispatchMode):
    def __init__(self, tracer: Tracer, cache: "meta_cache.MetaCache | None" = None):
        super().__init__()
        self.tracer = tracer
        self.cache = cache  # the MetaCache taken off the stack below this mode (meta_cache.py), run directly
        self.atomic = set()  # ids of ops that do not decompose (an OpOverload hashes in Python)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No torch._dynamo.disable wrapper around __torch_dispatch__ (two Python calls an op, with nodynamo's):
        nothing compiles under a trace."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.tracer.paused:
            return self.run(func, args, kwargs)
        op = aten_op(func)
        if op.decomposes and id(func) not in self.atomic:
            # as FlopCounterMode does: a composite op (aten.linear under inference_mode) is recorded as the
            # ops it decomposes into (t, addmm), which have FLOP formulas -- the same ops training runs
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
            self.atomic.add(id(func))  # remembered: asking again costs more than most ops
        # a collective on meta: what it returns, made without calling it (collectives.meta_result)
        out, duration_us = (meta_result(func, args) if op.collective is not None else None), None
        if out is None:
            out, duration_us = (self.tracer.timed(self.run, func, args, kwargs) if self.tracer.time_ops else
                                (self.run(func, args, kwargs), None))
        self.tracer.record_aten(func, op, args, kwargs, out, duration_us)
        return out

    def run(self, func, args, kwargs: dict):
        """func(*args, **kwargs) as the modes below run it (and the MetaCache taken off the stack)."""
        return func(*args, **kwargs) if self.cache is None else self.cache.run(func, args, kwargs)


class _FunctionMode(TorchFunctionMode):
    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not self.tracer.paused:
            out = fused_attention(self.tracer, *args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if torch.is_grad_enabled():
            self.tracer.tag_autograd_nodes(out)
        return out


def _modes_popped(modes) -> contextlib.ExitStack:
    """Our function and dispatch modes off their stacks until the returned stack is closed. If another mode
    sits above ours, nothing is popped: the layer then runs through our modes, paused."""
    popped = contextlib.ExitStack()
    function_mode, dispatch_mode = modes
    if _on_top(function_mode) and torch.utils._python_dispatch._get_current_dispatch_mode() is dispatch_mode:
        popped.enter_context(torch.overrides._pop_mode_temporarily())
        popped.enter_context(torch.utils._python_dispatch._pop_mode_temporarily())
    return popped


def _function_mode_popped(modes) -> contextlib.AbstractContextManager:
    """Our function mode off its stack while inside (nothing is popped if another mode sits above it)."""
    if modes and _on_top(modes[0]):
        return torch.overrides._pop_mode_temporarily()
    return contextlib.nullcontext()


def _on_top(function_mode) -> bool:
    """Is `function_mode` the innermost torch-function mode?"""
    return torch.overrides._get_current_function_mode_stack()[-1:] == [function_mode]


def _storage_key(t: torch.Tensor) -> int:
    try:  # (t.untyped_storage()._cdata, without making a storage object)
        return _storage_id(t)
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse): their own identity
        return id(t)


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += t.nbytes
    return total
