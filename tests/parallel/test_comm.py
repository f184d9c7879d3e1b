"""Collectives against torch references computed locally: real gloo ranks at world sizes 2, 3, 4 (one spawn
each, every check inside it), and the symbolic backend (no processes) as seen by the tracer."""
import pytest
import torch

from syntorch.parallel import distributed as comm
from syntorch.parallel.launch import init_distributed, spawn
from syntorch.parallel.mesh import Mesh, init_groups
from syntorch.trace.tracer import Tracer


def rank_input(r: int, n: int) -> torch.Tensor:
    """What rank r contributes: distinct per rank, known to every rank, so each can compute the reference."""
    g = torch.Generator().manual_seed(100 + r)
    return torch.rand(2 * n, 3 * n, generator=g) + 0.5  # positive and near 1, so prod stays finite


def check(name: str, got: torch.Tensor, want: torch.Tensor):
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        raise AssertionError(f"{name}: got {got.flatten()[:6].tolist()} want {want.flatten()[:6].tolist()}")


def collectives_rank():
    r, n = init_distributed("cpu")
    xs = torch.stack([rank_input(s, n) for s in range(n)])  # [n, 2n, 3n]: every rank's input
    x = xs[r]
    references = {"sum": xs.sum(0), "avg": xs.mean(0), "min": xs.min(0).values, "max": xs.max(0).values,
                  "prod": xs.prod(0)}
    for op, want in references.items():
        check(f"all_reduce {op}", comm.all_reduce(x.clone(), op), want)
    for dim in (0, 1, -1):
        check(f"all_gather dim {dim}", comm.all_gather(x, dim), torch.cat(list(xs), dim))
    for dim, op in ((0, "sum"), (1, "sum"), (0, "max"), (1, "min")):
        check(f"reduce_scatter dim {dim} {op}", comm.reduce_scatter(x, dim, op), references[op].chunk(n, dim)[r])
    check("broadcast", comm.broadcast(x.clone(), src=n - 1), xs[n - 1])
    check("all_to_all", comm.all_to_all(x), torch.cat([xs[s].chunk(n)[r] for s in range(n)]))
    # a ring: even ranks send first, odd ranks receive first, so blocking p2p cannot deadlock
    nxt, prev = (r + 1) % n, (r - 1) % n
    got = torch.empty_like(x)
    if r % 2 == 0:
        comm.send(x, nxt, tag=7)
        comm.recv(got, prev, tag=7)
    else:
        comm.recv(got, prev, tag=7)
        comm.send(x, nxt, tag=7)
    check("send/recv", got, xs[prev])
    comm.barrier()
    check_megatron_pairs(r, n, xs)
    check_mesh_groups(r, n)


def check_megatron_pairs(r: int, n: int, xs: torch.Tensor):
    """Forward and backward of each autograd-aware pair against the gradient worked out by hand."""
    cs = xs.flip(-1)  # per-rank loss weights, also known to every rank
    c = cs[r]

    def grad_of(fn, weights):
        x = xs[r].clone().requires_grad_()
        (fn(x) * weights).sum().backward()
        return x.grad

    check("copy_to_tp backward", grad_of(comm.copy_to_tp, c), cs.sum(0))
    check("reduce_from_tp backward", grad_of(lambda x: comm.reduce_from_tp(x * 1), c), c)
    full = torch.cat(list(cs), 1)  # the same on every rank
    check("gather_from_tp backward", grad_of(lambda x: comm.gather_from_tp(x, 1), full), full.chunk(n, 1)[r])
    chunk = c.chunk(n, 0)[0]
    check("reduce_scatter_to_sp backward", grad_of(lambda x: comm.reduce_scatter_to_sp(x * 1, 0), chunk),
          torch.cat([cs[s].chunk(n, 0)[0] for s in range(n)]))
    tall = torch.cat([c] * n)  # [n * 2n, 3n] on rank r
    check("gather_from_sp backward", grad_of(lambda x: comm.gather_from_sp(x, 0), tall),
          torch.cat([cs.sum(0)] * n).chunk(n)[r])
    check("split_to_sp backward", grad_of(lambda x: comm.split_to_sp(x, 0), chunk),
          torch.cat([cs[s].chunk(n, 0)[0] for s in range(n)]))


def check_mesh_groups(r: int, n: int):
    """With tp = n, the TP group is the whole world: an all-reduce over it equals one over the world."""
    groups = init_groups(Mesh(tp=n))
    assert groups.tp_rank == r
    check("all_reduce over the TP group", comm.all_reduce(torch.ones(3), group=groups.tp), torch.full((3,), float(n)))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_match_torch_reference(world):
    spawn(collectives_rank, world)


def test_symbolic_collectives_are_traced_with_group_bytes_and_order():
    """The fake backend runs every collective with no processes; the tracer sees each with its attributes."""
    with comm.symbolic_world(rank=1, world=4):
        x = torch.ones(8, 6, device="meta")
        with Tracer() as tracer:
            assert comm.all_reduce(x, "max").shape == (8, 6)
            assert comm.all_gather(x, 1).shape == (8, 24)
            assert comm.reduce_scatter(x, 0, "avg").shape == (2, 6)
            comm.broadcast(x, src=3)
            assert comm.all_to_all(x).shape == (8, 6)
            comm.send(x, dst=2, tag=5)
            comm.recv(x, src=0, tag=5)
            comm.barrier()
    got = [(d["collective"], d["reduce_op"], d["bytes"], d["src"], d["dst"], d["tag"], d["order"], d["group"])
           for _, d in tracer.graph.collectives()]
    full = 8 * 6 * 4
    assert got == [
        ("all_reduce", "max", full, None, None, 0, 0, [0, 1, 2, 3]),
        ("all_gather", None, 4 * full, None, None, 0, 1, [0, 1, 2, 3]),
        ("reduce_scatter", "avg", full, None, None, 0, 2, [0, 1, 2, 3]),
        ("broadcast", None, full, 3, None, 0, 3, [0, 1, 2, 3]),
        ("all_to_all", None, full, None, None, 0, 4, [0, 1, 2, 3]),
        ("send", None, full, 1, 2, 5, 5, [0, 1, 2, 3]),
        ("recv", None, full, 0, 1, 5, 6, [0, 1, 2, 3]),
        ("barrier", None, 0, None, None, 0, 7, [0, 1, 2, 3]),
    ]


def test_mesh_rejects_bad_degrees_in_one_line():
    from syntorch.errors import UserError
    with pytest.raises(UserError, match=r"dp\(2\) \* pp\(1\) \* tp\(4\) = 8 but the world has 6 ranks"):
        Mesh(dp=2, tp=4).check_world_size(6)
    with pytest.raises(UserError, match="--tp must be a positive integer, got 0"):
        Mesh(tp=0)


def test_reduce_ops_beyond_the_five_are_named_not_labelled_sum():
    import torch.distributed as dist

    from syntorch.trace.collectives import reduce_op_name
    assert [reduce_op_name(op) for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT)] == \
        ["sum", "avg", "prod"]
    assert [reduce_op_name(op) for op in (dist.ReduceOp.BAND, dist.ReduceOp.BXOR, dist.ReduceOp.PREMUL_SUM)] == \
        ["band", "bxor", "premul_sum"]
