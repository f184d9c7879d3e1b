"""Small hand-built TraceGraphs and the official .et reader, shared by the Chakra and validator tests."""
from chakra.schema.protobuf import et_def_pb2 as et
from chakra.src.third_party.utils.protolib import decodeMessage, openFileRd

from syntorch.trace.graph import TraceGraph

F32 = "torch.float32"


def tp_rank(rank: int, world: int = 2) -> TraceGraph:
    """A hand-built TP rank: mm -> view -> all_reduce -> gelu -> all_gather, then a broadcast and a barrier."""
    group = list(range(world))
    g = TraceGraph(model="toy", rank=rank, world_size=world, tp=world)
    x = g.add_tensor([4, 8], F32, 128)
    w = g.add_tensor([8, 8], F32, 256, is_param=True, name="fc.weight")
    y = g.add_tensor([4, 8], F32, 128)
    g.add_op("aten.mm", [x, w], [y], module="fc", flops=512, bytes_read=384, bytes_written=128)  # chakra 0
    v = g.add_tensor([32], F32, 128)
    g.add_op("aten.view", [y], [v], module="fc", is_view=True)  # folded
    z = g.add_tensor([32], F32, 128)
    g.add_collective("all_reduce", [v], [z], group=group, nbytes=128, reduce_op="sum")  # 1
    a = g.add_tensor([32], F32, 128)
    g.add_op("aten.gelu", [z], [a], module="act", flops=256, bytes_read=128, bytes_written=128)  # 2
    gathered = g.add_tensor([32 * world], F32, 128 * world)
    g.add_collective("all_gather", [a], [gathered], group=group, nbytes=128 * world)  # 3
    token = g.add_tensor([1], "torch.int64", 8)
    g.add_collective("broadcast", [token], [], group=group, nbytes=8, src=0)  # 4
    g.add_collective("barrier", [], [], group=group, nbytes=0)  # 5
    return g


def pp_rank(rank: int) -> TraceGraph:
    """Two pipeline stages: rank 0 computes and sends, rank 1 receives and computes."""
    g = TraceGraph(model="pipe", rank=rank, world_size=2, pp=2)
    x = g.add_tensor([4, 8], F32, 128)
    if rank == 0:
        y = g.add_tensor([4, 8], F32, 128)
        g.add_op("aten.relu", [x], [y], flops=32, bytes_read=128, bytes_written=128)
        g.add_collective("send", [y], [], group=[0, 1], nbytes=128, src=0, dst=1, tag=7)
    else:
        g.add_collective("recv", [], [x], group=[0, 1], nbytes=128, src=0, dst=1, tag=7)
        y = g.add_tensor([4, 8], F32, 128)
        g.add_op("aten.relu", [x], [y], flops=32, bytes_read=128, bytes_written=128)
    return g


def read_et(path):
    """The official reader: protolib over openFileRd, as chakra_jsonizer and the feeder read."""
    f = openFileRd(str(path))
    header, nodes = et.GlobalMetadata(), []
    assert decodeMessage(f, header)
    node = et.Node()
    while decodeMessage(f, node):
        nodes.append(node)
        node = et.Node()
    f.close()
    return header, nodes


def attrs(node) -> dict:
    return {a.name: a for a in node.attr}
