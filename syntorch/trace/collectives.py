"""What a c10d op seen in the dispatch mode means: kind, group's global ranks, reduce op, bytes, peers.

torch.distributed's collectives reach a TorchDispatchMode as `c10d.*` ops (real gloo/NCCL and the fake
backend alike) whose process group and reduce op are TorchScript objects; functional collectives
(`torch.distributed._functional_collectives`) arrive as `_c10d_functional.*` ops naming their group.
`bytes` is the per-rank buffer a collective works on: the whole tensor for all-reduce and broadcast, the
gathered (larger) tensor for all-gather and reduce-scatter, as nccl-tests count a collective's size.
On meta a c10d op moves nothing, and the tracer records it with the result it would return (`meta_result`).
"""
import math
from dataclasses import dataclass, field

import torch.distributed as dist
from torch._C._distributed_c10d import FakeWork

from syntorch.parallel.distributed import REDUCE_OPS
from syntorch.trace.values import flat_tensors

REDUCE_OP_NAMES = {op: name for name, op in REDUCE_OPS.items()}  # ReduceOp.RedOpType -> our name

# c10d op -> (collective, argument holding the inputs, argument holding the outputs)
C10D_OPS = {
    "allreduce_": ("all_reduce", "tensors", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors", "tensors"),
    "_allgather_base_": ("all_gather", "input_tensor", "output_tensor"),
    "allgather_": ("all_gather", "input_tensors", "output_tensors"),
    "allgather_into_tensor_coalesced_": ("all_gather", "inputs", "outputs"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor", "output_tensor"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors", "output_tensors"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs", "outputs"),
    "broadcast_": ("broadcast", "tensors", "tensors"),
    "alltoall_base_": ("all_to_all", "input", "output"),
    "alltoall_": ("all_to_all", "input_tensors", "output_tensors"),
    "send": ("send", "tensors", None),
    "recv_": ("recv", None, "tensors"),
    "recv_any_source_": ("recv", None, "tensors"),
    "barrier": ("barrier", None, None),
}
# c10d ops whose run on meta tensors is torch's meta kernel alone (torch/distributed/_meta_registrations.py, any
# backend): it moves nothing and returns a new FakeWork after its first argument (True) or alone (False)
META_KERNELS = {"allreduce_": True, "_allgather_base_": True, "allgather_": True, "_reduce_scatter_base_": True,
                "reduce_scatter_": True, "broadcast_": True, "alltoall_": True, "alltoall_base_": False,
                "send": False, "recv_": False, "recv_any_source_": False, "barrier": False}
FUNCTIONAL_OPS = {  # functional collectives return a new tensor
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "all_to_all_single": "all_to_all", "broadcast": "broadcast",
}


@dataclass
class CollectiveCall:
    name: str
    collective: str
    group: list[int]
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    nbytes: int = 0
    reduce_op: str | None = None
    src: int | None = None
    dst: int | None = None
    tag: int = 0
    peer_bytes: dict = field(default_factory=dict)  # all-to-all with splits: send_bytes/recv_bytes per member


def collective_call(func, arguments: tuple, args, kwargs, out) -> CollectiveCall | None:
    """The collective `func` runs, or None for c10d ops that move no data (e.g. wait_tensor). `arguments`: the
    (name, default) of each of its schema's arguments (aten_ops.AtenOp.collective: a schema is slow to read)."""
    values = {name: (args[i] if i < len(args) else kwargs.get(name, default))
              for i, (name, default) in enumerate(arguments)}
    op = func._overloadpacket.__name__
    if func.namespace == "c10d" and op in C10D_OPS:
        kind, in_arg, out_arg = C10D_OPS[op]
        pg = dist.ProcessGroup.unbox(values["process_group"])
        call = CollectiveCall(f"c10d.{op}", kind, dist.get_process_group_ranks(pg),
                              flat_tensors(values.get(in_arg)), flat_tensors(values.get(out_arg)))
        _peers(call, pg, values)
    elif func.namespace == "_c10d_functional" and op in FUNCTIONAL_OPS:
        pg = dist.distributed_c10d._resolve_process_group(values["group_name"])
        call = CollectiveCall(f"_c10d_functional.{op}", FUNCTIONAL_OPS[op], dist.get_process_group_ranks(pg),
                              flat_tensors(values.get("input") or values.get("inputs")), flat_tensors(out))
        if "src" in values:
            call.src = dist.get_global_rank(pg, values["src"])
        reduce_op = values.get("reduce_op")
        call.reduce_op = reduce_op.lower().replace("product", "prod") if isinstance(reduce_op, str) else None
    else:
        return None
    call.nbytes = max(_bytes(call.inputs), _bytes(call.outputs))
    if call.collective == "all_to_all" and values.get("input_split_sizes"):
        call.peer_bytes = _split_bytes(call, values["input_split_sizes"], values["output_split_sizes"])
    return call


def meta_result(func, args: tuple):
    """What c10d op `func` returns when its tensors are on meta, as its meta kernel makes it, without calling
    it; None for ops to call. Called from Python, a c10d op spends ~20 us converting its TorchScript arguments
    back (several times what recording it costs; a 175B probe calls ~350). FakeWork is a private name of
    torch's, unavoidably: it is the meta kernel's own result, and no public Work completes (a Python subclass
    of dist.Work loses its `wait` when boxed, and c10d's wait then blocks)."""
    returns_first = META_KERNELS.get(func._overloadpacket.__name__) if func.namespace == "c10d" else None
    if returns_first is None:
        return None
    tensors = flat_tensors(args)
    if not tensors or not all(t.is_meta for t in tensors):
        return None
    work = FakeWork().boxed()
    return (args[0], work) if returns_first else work


def _split_bytes(call: CollectiveCall, in_splits, out_splits) -> dict:
    """The bytes a variable all-to-all sends to and receives from each member (in group order): its splits
    count rows, each row the input's bytes per first-dimension entry. Chakra writes a skewed load's
    all-to-all as these sends and recvs (chakra/nodes.py)."""
    x = call.inputs[0]
    row = x.element_size() * math.prod(x.shape[1:])
    return {"send_bytes": [int(n) * row for n in in_splits], "recv_bytes": [int(n) * row for n in out_splits]}


def _peers(call: CollectiveCall, pg, values: dict):
    """Reduce op, and src/dst/tag as global ranks (c10d ops carry group-local ones)."""
    if "reduce_op" in values:
        call.reduce_op = reduce_op_name(values["reduce_op"].op())
    if call.collective == "broadcast":
        call.src = dist.get_global_rank(pg, values["root_rank"])
    if call.collective == "send":
        call.src, call.dst = dist.get_rank(), dist.get_global_rank(pg, values["dst"])
    if call.collective == "recv" and "src" in values:
        call.src, call.dst = dist.get_global_rank(pg, values["src"]), dist.get_rank()
    call.tag = int(values.get("tag") or 0)


def reduce_op_name(op) -> str:
    """sum/avg/min/max/prod, or torch's own name for the others (band, bor, bxor, premul_sum): a bitwise
    reduction is not a sum, and the graph says so rather than guess."""
    return REDUCE_OP_NAMES.get(op) or str(op).rsplit(".", 1)[-1].lower()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
