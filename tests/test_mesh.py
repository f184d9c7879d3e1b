"""The named mesh (parallel/mesh.py) as pure logic, as torchtitan's test_parallel_dims: ranks round-trip through
coordinates in Megatron's layout, each named group has the documented stride, flattened groups are unions,
EP sits inside DP, translation maps groups onto groups."""
import pytest

from syntorch.errors import UserError
from syntorch.parallel.mesh import DIMS, Mesh

MESHES = [Mesh(dp=2, pp=2, tp=2), Mesh(dp=2, pp=2, tp=2, cp=2), Mesh(dp=3, pp=2, tp=2, cp=2),
          Mesh(dp=4, pp=2, tp=2, ep=2), Mesh(dp=4, cp=2, ep=4), Mesh(dp=6, pp=1, tp=1, ep=3),
          Mesh(dp=2, tp=4, etp=1, ep=4), Mesh(dp=2, tp=2, cp=2, pp=2, etp=1, ep=8),
          Mesh(dp=4, tp=4, pp=2, etp=2, ep=4), Mesh(dp=4, tp=2, cp=2, pp=3, ep=4)]


def megatron_rank(m: Mesh, dp: int, pp: int, cp: int, tp: int) -> int:
    """Megatron-LM's "tp-cp-pp-dp" rank, written out (parallel_state's order, TP innermost)."""
    return ((dp * m.pp + pp) * m.cp + cp) * m.tp + tp


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_ranks_round_trip_through_named_coordinates_in_megatrons_order(mesh):
    assert DIMS == ("tp", "cp", "pp", "dp")
    seen = set()
    for rank in range(mesh.world_size):
        c = mesh.coordinate(rank)
        assert c._fields == DIMS and all(0 <= getattr(c, d) < getattr(mesh, d) for d in DIMS)
        assert mesh.rank_of(**c._asdict()) == rank == megatron_rank(mesh, c.dp, c.pp, c.cp, c.tp)
        seen.add(c)
    assert len(seen) == mesh.world_size


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_each_named_group_is_a_line_with_the_documented_stride(mesh):
    strides = {"tp": 1, "cp": mesh.tp, "pp": mesh.cp * mesh.tp, "dp": mesh.pp * mesh.cp * mesh.tp}
    for name, stride in strides.items():
        groups = mesh.groups(name)
        assert sorted(r for g in groups for r in g) == list(range(mesh.world_size))  # a partition
        assert mesh.stride(name) == stride
        for g in groups:
            assert g == [g[0] + i * stride for i in range(getattr(mesh, name))]
            others = {d: {getattr(mesh.coordinate(r), d) for r in g} for d in DIMS if d != name}
            assert all(len(v) == 1 for v in others.values()), (name, g)
            assert [mesh.index(r, name) for r in g] == list(range(len(g)))


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_the_flattened_dp_cp_group_is_the_union_of_its_cp_groups_over_dp(mesh):
    for rank in range(mesh.world_size):
        union = sorted({r for d in mesh.group(rank, "dp") for r in mesh.group(d, "cp")})
        assert mesh.group(rank, "dp", "cp") == mesh.group(rank, "cp", "dp") == union
        assert len(union) == mesh.size("dp", "cp") == mesh.dp * mesh.cp
        c = mesh.coordinate(rank)  # the place of a rank in the gradient group: its share of the batch
        assert mesh.index(rank, "dp", "cp") == c.dp * mesh.cp + c.cp == union.index(rank)
    last = mesh.pp - 1
    assert mesh.stage_ranks(last) == [r for r in range(mesh.world_size) if mesh.coordinate(r).pp == last]


def megatron_expert_groups(mesh: Mesh, kind: str) -> list[list[int]]:
    """Megatron-Core's expert groups written out: its expert RankGenerator re-factors each stage's ranks, in
    their dense order (tp, then cp, then dp), as etp x ep x expert_dp."""
    out = []
    for stage in range(mesh.pp):
        ranks = [megatron_rank(mesh, dp, stage, cp, tp) for dp in range(mesh.dp) for cp in range(mesh.cp)
                 for tp in range(mesh.tp)]
        etp, ep, edp = mesh.etp, mesh.ep, len(ranks) // (mesh.etp * mesh.ep)
        at = {"etp": lambda i, j, k: i + etp * (j + ep * k), "ep": lambda j, i, k: i + etp * (j + ep * k),
              "expert_dp": lambda k, i, j: i + etp * (j + ep * k)}[kind]
        sizes = {"etp": (etp, ep, edp), "ep": (ep, etp, edp), "expert_dp": (edp, etp, ep)}[kind]
        out += [sorted(ranks[at(a, b, c)] for a in range(sizes[0])) for b in range(sizes[1]) for c in range(sizes[2])]
    return sorted(out)


@pytest.mark.parametrize("mesh", [m for m in MESHES if m.ep > 1], ids=str)
def test_expert_groups_are_megatron_cores(mesh):
    for kind in ("etp", "ep", "expert_dp"):
        assert mesh.groups(kind) == megatron_expert_groups(mesh, kind), kind
        for rank in range(mesh.world_size):
            assert mesh.index(rank, kind) == mesh.group(rank, kind).index(rank)
    assert mesh.size("etp", "ep", "expert_dp") == mesh.tp * mesh.cp * mesh.dp


@pytest.mark.parametrize("mesh", [m for m in MESHES if m.ep > 1 and m.cp == 1 and m.etp == m.tp], ids=str)
def test_ep_splits_dp_into_neighbours_and_expert_dp_strides_by_ep(mesh):
    outer = mesh.dp // mesh.ep
    for rank in range(mesh.world_size):
        dp_line, ep, edp = mesh.group(rank, "dp"), mesh.group(rank, "ep"), mesh.group(rank, "expert_dp")
        d = mesh.coordinate(rank).dp
        assert [mesh.coordinate(r).dp for r in ep] == list(range(d - d % mesh.ep, d - d % mesh.ep + mesh.ep))
        assert [mesh.coordinate(r).dp for r in edp] == list(range(d % mesh.ep, mesh.dp, mesh.ep))
        assert set(ep) & set(edp) == {rank} and len(edp) == outer
        assert sorted(r for e in edp for r in mesh.group(e, "ep")) == dp_line  # EP x expert-DP = DP
        assert mesh.index(rank, "ep") == d % mesh.ep


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_translation_maps_groups_onto_groups_keeps_the_stage_and_goes_back(mesh):
    kinds = [("tp",), ("cp",), ("dp",), ("dp", "cp"), ("ep",), ("expert_dp",), ("etp",)]
    for names in kinds:
        groups = {tuple(g) for g in mesh.groups(*names)}
        for to in range(mesh.world_size):
            for g in groups:
                moved = [mesh.translate(r, to) for r in g]
                assert tuple(sorted(moved)) in groups, (names, g, to)
                assert [mesh.translate(r, to, back=True) for r in moved] == list(g)
    for rank in range(mesh.world_size):
        stage = mesh.coordinate(rank).pp
        assert mesh.translate(mesh.representative(stage), rank) == rank
        assert mesh.coordinate(mesh.translate(rank, mesh.world_size - 1)).pp == stage


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_every_process_group_is_named_by_its_kind(mesh):
    """The name the simulator's streams carry (Mesh.name) is the kind the group was created as."""
    for kind, ranks in mesh.process_groups(tied=True):
        expected = "pp" if kind in ("stage_pair", "embedding") else kind
        if kind == "ep" and mesh.ep == mesh.dp and mesh.cp == 1 and mesh.etp == mesh.tp:
            assert mesh.dims_of(ranks) == ("dp",)  # the EP group is the whole DP line
        if kind in ("ep", "expert_dp", "etp") and set(mesh.dims_of(ranks)) <= set(DIMS):
            expected = "_".join(mesh.dims_of(ranks))  # an expert group that is a dense one (TP, DP, DP x CP)
        if kind in ("model_parallel", "world") and (len(mesh.dims_of(ranks)) == 1 or set(mesh.dims_of(ranks)) == {"dp", "cp"}):
            expected = mesh.name(mesh.group(ranks[0], *mesh.dims_of(ranks)))  # the norm's group is a named one
        if len(ranks) == 1:
            expected = "self"
        assert mesh.name(ranks) == expected, (kind, ranks)
    assert mesh.name([0]) == "self"


def test_groups_of_a_2x2x2_mesh_and_cp_between_tp_and_pp():
    mesh = Mesh(dp=2, pp=2, tp=2)
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert "cp" not in [kind for kind, _ in mesh.process_groups()]
    cp = Mesh(dp=2, pp=2, tp=2, cp=2)
    assert [cp.coordinate(r) for r in (2, 5, 13)] == [(0, 1, 0, 0), (1, 0, 1, 0), (1, 0, 1, 1)]
    assert cp.coordinate(13).dp == 1 and cp.rank_of(dp=1, pp=1, tp=1) == 13
    assert cp.group(5, "cp") == [5, 7] and cp.group(0, "pp") == [0, 4] and cp.group(0, "dp") == [0, 8]
    assert cp.groups("dp", "cp")[0] == [0, 2, 8, 10]
    kinds = [kind for kind, _ in cp.process_groups()]
    assert kinds.count("cp") == 8 and kinds.count("dp_cp") == 4
    assert cp.representative(1) == 4 and cp.translate(4, 2) == 6 and cp.translate(6, 11) == 13


def test_names_only():
    mesh = Mesh(dp=2, tp=2)
    with pytest.raises(TypeError):
        Mesh(2, 1, 2)  # noqa: the positional (dp, pp, tp) order is gone
    with pytest.raises(ValueError, match="no mesh dimension 'tensor'"):
        mesh.group(0, "tensor")
    with pytest.raises(ValueError, match="tp index 2 is outside 0..1"):
        mesh.rank_of(tp=2)
    assert Mesh(**Mesh(dp=4, cp=2, ep=2, ring=True).to_json()) == Mesh(dp=4, cp=2, ep=2, ring=True)
    with pytest.raises(UserError, match="--ep 3 must divide --dp 2"):
        Mesh(dp=2, ep=3)
