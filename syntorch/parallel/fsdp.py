"""Fully-sharded data parallelism (ZeRO-3, `--zero 3` / `--fsdp`): parameters live sharded over the gradient
group (DP, or DP x CP) and are whole only around their layer's forward and backward.

Units: each transformer layer is one (with expert parallelism two: its experts are a unit of their own over
the expert-data-parallel group, the ranks holding the same experts, as torchtitan shards them on its
dp_mod_ep mesh; their gradients are still averaged over the grad group's size, torchtitan's gradient divide
factor, since each already sums the tokens of a whole EP group); the stage's other parameters (embeddings,
final norm, head) another, and a weight tied across the first and last stage one of its own (so its shard lines up on both stages and
Megatron's embedding group can sum its gradient). Each unit's parameters are one flat buffer padded to a
multiple of the group size, of which this rank keeps 1/n (FSDP1's flat parameter; one all-gather and one
reduce-scatter per unit, as FSDP2 also issues per layer); the optimizer updates the shards.

Per micro-batch, as FSDP2 runs it:
- forward: a unit is all-gathered before it runs and freed after it (the non-layer units too: FSDP2 keeps the
  root whole until its backward, but freeing it makes every micro-batch's step alike, whatever the pipeline
  schedule interleaves); before unit i computes, unit i+1's all-gather is issued (forward prefetch);
- backward: when the gradient of unit i's output is ready, unit i is all-gathered again and unit i-1's
  all-gather issued (backward prefetch); when every gradient of unit i is accumulated, they are summed over
  the ranks that hold parts of them (sequence-parallel LayerNorms over TP), flattened, reduce-scattered
  (averaged) into this rank's shard gradient, and the unit is freed. Gradients are reduce-scattered every
  micro-batch and accumulate in the shard, as FSDP2's default does.
With `reshard_after_forward=False` (FSDP2's option, as Llama 3 runs it: Dubey et al. 2024, section 3.3.2) a
unit stays whole after its forward, and after each micro-batch's backward too until the step's last one (as
torch.distributed.pipelining runs FSDP2 modules: set_reshard_after_backward(False) but for the last
backward): the first forward all-gathers each unit once, no other forward or backward does, whatever the
schedule; the gradients are still reduce-scattered every micro-batch. The price is every unit of the stage
whole for the step (memory.py).
With `reduce_fp32` (--grad_reduce_dtype fp32; FSDP2's MixedPrecisionPolicy(reduce_dtype=torch.float32))
the flattened gradients are cast to FP32 before the reduce-scatter, so it moves 4-byte elements and sums
in FP32; the reduced shard is cast back to the model dtype, where it accumulates.
Each all-gather reads a copy of the shard (FSDP2's copy-in) made together with a 0-element tensor taken from the activation
(or gradient) that was current when it was issued: real runs move no extra data, and a trace orders the
collective after the compute before it, as FSDP2's all-gather stream waits for the compute stream.
"""
import weakref

import torch
import torch.nn as nn

from syntorch.errors import UserError
from syntorch.parallel import distributed as comm
from syntorch.parallel.expert import is_expert_param

GRAD_REDUCE_DTYPES = ("model", "fp32")


def check_grad_options(reshard_after_forward: bool, grad_reduce_dtype: str, zero: int) -> None:
    if grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
        raise UserError(f"--grad_reduce_dtype must be one of {', '.join(GRAD_REDUCE_DTYPES)}, got {grad_reduce_dtype!r}")
    if not reshard_after_forward and zero != 3:
        raise UserError(f"--reshard_after_forward false keeps FSDP's gathered parameters until backward; it needs "
                        f"--zero 3 (--fsdp), got --zero {zero}")


class Unit:
    """One unit's parameters: views into one flat buffer whose storage exists only while they are whole
    (freed by resizing it to 0 bytes, as FSDP does, so tensors autograd saved from them, e.g. a weight's
    transpose, are freed too and see the re-gathered values in backward), and this rank's shard of it.
    Gradients are summed over the group and divided by `divisor` (default its size). A group of one rank
    (experts over all of a stage's ranks) holds the whole: gathering is a copy, reducing the division."""

    def __init__(self, params: list[nn.Parameter], group, size: int, owner: nn.Module, name: str,
                 reduce_fp32: bool = False, divisor: int = 0):
        self.params, self.group, self.size, self.reduce_fp32 = params, group, size, reduce_fp32
        self.divisor = divisor or size
        numel = sum(p.numel() for p in params)
        padded = -(-numel // size) * size
        self.buffer = torch.cat([p.detach().reshape(-1) for p in params] + [params[0].new_zeros(padded - numel)])
        owner.register_buffer(name, self.buffer, persistent=False)  # named state, as traces see it
        self.shard = nn.Parameter((comm.own_chunk(self.buffer, 0, group) if size > 1 else self.buffer).clone())
        offset = 0
        for p in params:
            p.data = self.buffer[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        self.whole = True
        self.ready = 0  # gradients accumulated in this backward
        self.free()

    @torch.no_grad()
    def gather(self, after: torch.Tensor) -> None:
        """Make the parameters whole (issued after `after` was computed); nothing if they are."""
        if self.whole:
            return
        self.buffer.untyped_storage().resize_(self.buffer.numel() * self.buffer.element_size())
        copy_in = torch.cat([after.new_empty(0, dtype=self.shard.dtype), self.shard.detach()])
        # copied out of the all-gather's output into the parameters' storage, as FSDP2's copy-out does (a
        # trace then shows the write reading the storage's earlier version, like any in-place update)
        self.buffer.copy_(comm.all_gather(copy_in, 0, self.group) if self.size > 1 else copy_in)
        self.whole = True

    def free(self) -> None:
        self.buffer.untyped_storage().resize_(0)
        self.whole = False

    @torch.no_grad()
    def reduce(self, partial: dict, free: bool = True) -> None:
        """Every gradient is in: sum those other ranks hold parts of (`partial`: id(param) -> group) over
        their group, reduce-scatter the average into the shard's gradient, free the parameters (if `free`)."""
        grads = [p.grad for p in self.params]
        for p in self.params:
            if id(p) in partial:
                comm.all_reduce(p.grad, "sum", partial[id(p)])
        numel = sum(g.numel() for g in grads)
        padded = self.shard.numel() * self.size
        flat = torch.cat([g.reshape(-1) for g in grads] + ([grads[0].new_zeros(padded - numel)] if padded > numel else []))
        if self.reduce_fp32:
            flat = flat.float()
        flat = flat.div_(self.divisor)
        part = (comm.reduce_scatter(flat, 0, "sum", self.group) if self.size > 1 else flat).to(self.shard.dtype)
        if self.shard.grad is None:
            self.shard.grad = part
        else:
            self.shard.grad.add_(part)
        for p in self.params:
            p.grad = None
        self.ready = 0
        if free:
            self.free()


class FullyShard:
    """FSDP over a stage model: what GradSync is for DDP/ZeRO-1/2, with the same four members the training
    step uses (`active`, `finish`, `gather_params`, `optimizer_params`)."""

    def __init__(self, model: nn.Module, group, size: int, partial: list[tuple[list, object]] = (),
                 tied=None, reshard_after_forward: bool = True, reduce_fp32: bool = False,
                 experts: tuple[object, int] | None = None):
        """`partial`: (parameters, group) whose gradients each rank of group holds a part of; a tied
        weight's group (the embedding pair) is summed at the end of the step, others per backward.
        `reshard_after_forward`, `reduce_fp32`: the module docstring. `experts`: (expert-DP group, its size)
        to shard each layer's experts over (expert parallelism)."""
        self.reshard_after_forward = reshard_after_forward
        # every backward reduce-scatters; True in the step's last backward, when units not resharded are freed
        self.active = False
        self.tied_group = None
        tied_params = []
        self.partial = {}
        for params, pgroup in partial:
            if tied is not None and pgroup is tied:
                tied_params, self.tied_group = list(params), pgroup
            else:
                self.partial.update({id(p): pgroup for p in params})
        layers = list(getattr(model, "layers", {}).values())
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        tied_ids = {id(p) for p in tied_params}
        rest = [p for p in model.parameters() if id(p) not in in_layers and id(p) not in tied_ids]
        self.tied = Unit(tied_params, group, size, model, "fsdp_tied", reduce_fp32) if tied_params else None
        self.ends = [u for u in (self.tied, Unit(rest, group, size, model, "fsdp_flat", reduce_fp32) if rest else None)
                     if u]
        self.layers = [self._layer_units(layer, group, size, reduce_fp32, experts) for layer in layers]
        self.units = [*self.ends, *(unit for units in self.layers for unit in units)]
        # the model's own units: before its first layer in forward, before its last one in backward
        self._hook(model, self.ends, self.layers[0] if self.layers else [], self.layers[-1] if self.layers else [])
        for i, (layer, units) in enumerate(zip(layers, self.layers)):
            self._hook(layer, units, self.layers[i + 1] if i + 1 < len(layers) else [],
                       self.layers[i - 1] if i else [])
        # the hooks hold neither this object nor a unit: a parameter's hooks live in torch's C++ grad accumulator,
        # where the cyclic collector cannot see a cycle through unit.params (each FSDP task leaked its units,
        # parameters and shards for good), as buckets.GradSync's
        self._unit_of = {id(p): unit for unit in self.units for p in unit.params}
        ready = weakref.WeakMethod(self._grad_ready)
        for unit in self.units:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p: ready()(p))

    @staticmethod
    def _layer_units(layer: nn.Module, group, size: int, reduce_fp32: bool, experts) -> list[Unit]:
        """A layer's unit, or with `experts` its dense unit and its experts' unit (module docstring)."""
        named = list(layer.named_parameters())
        routed = [p for n, p in named if is_expert_param("." + n)] if experts else []
        if not routed:
            return [Unit([p for _, p in named], group, size, layer, "fsdp_flat", reduce_fp32)]
        dense = [p for n, p in named if not is_expert_param("." + n)]
        return [Unit(dense, group, size, layer, "fsdp_flat", reduce_fp32),
                Unit(routed, *experts, layer, "fsdp_experts", reduce_fp32, divisor=size)]

    def _hook(self, module: nn.Module, units: list[Unit], forward_next: list[Unit], backward_next: list[Unit]) -> None:
        """Gather `units` before `module` runs, prefetching `forward_next`, and free them after; gather them
        again when the gradient of its output arrives, prefetching `backward_next`."""
        def pre_forward(_module, args):
            x = args[0]
            for unit in [*units, *forward_next]:
                unit.gather(x)

        def post_forward(_module, _args, out):
            for unit in units if self.reshard_after_forward else ():
                unit.free()
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(pre_backward)

        def pre_backward(grad):
            for unit in [*units, *backward_next]:
                unit.gather(grad)

        module.register_forward_pre_hook(pre_forward)
        module.register_forward_hook(post_forward)

    def _grad_ready(self, param: nn.Parameter) -> None:
        unit = self._unit_of[id(param)]
        unit.ready += 1
        if unit.ready == len(unit.params):
            unit.reduce(self.partial, self.reshard_after_forward or self.active)

    @torch.no_grad()
    def finish(self) -> None:
        """End of the step's backward: a weight tied across the first and last stage sums its gradient over
        the pair (both hold it as a unit of its own, so their shards line up)."""
        if self.tied is not None and self.tied_group is not None:
            comm.all_reduce(self.tied.shard.grad, "sum", self.tied_group)

    def gather_params(self) -> None:
        """Nothing: the next forward all-gathers the updated shards."""

    def optimizer_params(self) -> list[nn.Parameter]:
        return [unit.shard for unit in self.units]

    @torch.no_grad()
    def full_parameters(self) -> None:
        """Every parameter whole (checkpoints and checks after a step)."""
        for unit in self.units:
            unit.gather(unit.shard)
