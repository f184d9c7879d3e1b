"""Per-node durations from a HardwareConfig: roofline for compute, ring alpha-beta for collectives.

Compute (op nodes):  max(flops / peak[dtype], (bytes_read + bytes_written) / memory bandwidth).
Collectives (n ranks, B = the node's `bytes`: the larger of its input and output buffer, as nccl-tests
count a collective's size; alpha = latency per ring step, beta = 1 / link bandwidth, inter-node figures
when the group spans nodes):
    all_reduce      2(n-1) alpha + 2(n-1)/n B beta     (reduce-scatter then all-gather)
    reduce_scatter  (n-1) alpha  + (n-1)/n B beta      (B is the input)
    all_gather      (n-1) alpha  + (n-1)/n B beta      (B is the output)
    all_to_all      (n-1) alpha  + (n-1)/n B beta
    broadcast       (n-1) alpha  + B beta              (pipelined ring)
    send / recv     alpha + B beta
    barrier         2(n-1) alpha                       (an all-reduce of nothing)
"""
import networkx as nx

from syntorch.hardware import HardwareConfig

# collective -> (ring steps, fraction of B each rank moves) for n ranks
RING = {
    "all_reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
    "reduce_scatter": lambda n: (n - 1, (n - 1) / n),
    "all_gather": lambda n: (n - 1, (n - 1) / n),
    "all_to_all": lambda n: (n - 1, (n - 1) / n),
    "broadcast": lambda n: (n - 1, 1.0),
    "send": lambda n: (1, 1.0),
    "recv": lambda n: (1, 1.0),
    "barrier": lambda n: (2 * (n - 1), 0.0),
}


def compute_us(flops: int, nbytes: int, dtype: str, hw: HardwareConfig) -> float:
    """Roofline: the slower of doing the math and moving the bytes."""
    return 1e6 * max(flops / hw.peak_flops(dtype), nbytes / (hw.memory_bw_gb_s * 1e9))


def collective_us(collective: str, nbytes: int, ranks: list[int], hw: HardwareConfig) -> float:
    """Ring alpha-beta time of one collective over `ranks` (global ranks; p2p: the two peers)."""
    n = len(set(ranks))
    if n <= 1:
        return 0.0
    steps, fraction = RING[collective](n)
    one_node = len({r // hw.devices_per_node for r in ranks}) == 1
    bw = hw.intra_node_bw_gb_s if one_node else hw.inter_node_bw_gb_s
    latency = hw.intra_node_latency_us if one_node else hw.inter_node_latency_us
    return steps * latency + 1e6 * fraction * nbytes / (bw * 1e9)



def node_us(graph: nx.DiGraph, node, hw: HardwareConfig) -> float:
    data = graph.node_attrs[node]
    if data["kind"] == "collective":
        return collective_us(data["collective"], data["bytes"], _peers(graph, data), hw)
    if data.get("is_view"):
        return 0.0
    return compute_us(data["flops"], data["bytes_read"] + data["bytes_written"], op_dtype(graph, node), hw)


def fill_durations(graph: nx.DiGraph, hw: HardwareConfig) -> None:
    """Sets `duration_us` on every op and collective node of `graph` (in place)."""
    for node, data in graph.node_attrs.items():
        if data["kind"] != "tensor":
            data["duration_us"] = node_us(graph, node, hw)


def op_dtype(graph: nx.DiGraph, node) -> str:
    """The dtype an op computes in: its first floating-point output, else input, else float32."""
    dtypes = (graph.node_attrs[t]["dtype"].removeprefix("torch.") for t in (*graph.succs[node], *graph.preds[node]))
    return next((d for d in dtypes if d.startswith(("float", "bfloat"))), "float32")


def _peers(graph: nx.DiGraph, data: dict) -> list[int]:
    if data["collective"] in ("send", "recv"):
        rank = graph.graph.get("rank", 0)
        peer = data["dst"] if data["collective"] == "send" else data["src"]
        return [rank, rank if peer is None else peer]
    return data["group"]


def latency_us(graph: nx.DiGraph, hw: HardwareConfig | None = None) -> dict:
    """Per-rank estimate: `serial_us` (every node one after another: one stream, no overlap) and
    `critical_path_us` (longest dependency chain: perfect overlap). Uses `duration_us`, or `hw` if given."""
    duration = {n: (node_us(graph, n, hw) if hw else d.get("duration_us") or 0.0)
                for n, d in graph.nodes(data=True) if d["kind"] != "tensor"}
    finish = {}
    for node in nx.topological_sort(graph):
        if node not in duration:
            continue
        start = max((finish[p] for t in graph.predecessors(node) for p in graph.predecessors(t)), default=0.0)
        finish[node] = start + duration[node]
    return {"serial_us": sum(duration.values()), "critical_path_us": max(finish.values(), default=0.0)}


def shared_key(graph: nx.DiGraph) -> int:
    """Equal for ranks that share one graph's nodes (RankTraces.put_shared gives them views of it)."""
    return id(graph.nodes[next(iter(graph))]) if len(graph) else id(graph)


def fill_rank_durations(graphs_by_rank, hw: HardwareConfig) -> None:
    """fill_durations on every rank's graph, once per distinct graph (shared ones share durations)."""
    distinct = {shared_key(g): g for g in graphs_by_rank.values()}
    for graph in distinct.values():
        fill_durations(graph, hw)
