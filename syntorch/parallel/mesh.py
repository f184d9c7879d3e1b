"""The (dp, pp, tp) device mesh: which global rank does what, and its process groups.

Rank layout (Megatron's order, TP innermost so a TP group sits on one node's fast links):

    rank = ((dp_idx * pp) + pp_stage) * tp + tp_rank

so with dp=2, pp=2, tp=2: ranks 0,1 are TP group (dp 0, stage 0); 2,3 (dp 0, stage 1); 4,5 (dp 1, stage 0) ...
A TP group is tp consecutive ranks; a PP group strides by tp; a DP group strides by pp * tp.
"""
from dataclasses import dataclass

import torch.distributed as dist

from syntorch.errors import UserError

DIMS = ("dp", "pp", "tp")


@dataclass(frozen=True)
class Mesh:
    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self):
        for dim in DIMS:
            size = getattr(self, dim)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise UserError(f"parallel degree --{dim} must be a positive integer, got {size!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise UserError(f"dp({self.dp}) * pp({self.pp}) * tp({self.tp}) = {self.world_size} "
                            f"but the world has {world_size} ranks; make the product equal the rank count")

    def rank(self, dp_idx: int, pp_stage: int, tp_rank: int) -> int:
        return ((dp_idx * self.pp) + pp_stage) * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_idx, pp_stage, tp_rank) of a global rank."""
        return rank // (self.pp * self.tp), rank // self.tp % self.pp, rank % self.tp

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """The global ranks of `rank`'s group along `dim` (the ranks that differ from it only in that index)."""
        c, axis = list(self.coords(rank)), DIMS.index(dim)
        return [self.rank(*c[:axis], i, *c[axis + 1:]) for i in range(getattr(self, dim))]

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along `dim`, in a fixed order (each rank must create all of them, in this order)."""
        seen = {}
        for r in range(self.world_size):
            ranks = self.group_ranks(dim, r)
            seen.setdefault(ranks[0], ranks)
        return list(seen.values())


@dataclass
class MeshGroups:
    """This rank's place in the mesh and its process groups, one per mesh dimension."""
    mesh: Mesh
    rank: int
    tp: object  # torch ProcessGroup
    pp: object
    dp: object

    @property
    def tp_rank(self) -> int:
        return self.mesh.coords(self.rank)[2]


def init_groups(mesh: Mesh) -> MeshGroups:
    """Create the process groups of every dimension (collective: every rank calls it) and return this rank's.

    The default process group must be up (launch.init_distributed or comm.symbolic_world).
    """
    mesh.check_world_size(dist.get_world_size())
    rank = dist.get_rank()
    mine = {}
    for dim in DIMS:
        for ranks in mesh.groups(dim):
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[dim] = group
    return MeshGroups(mesh, rank, **mine)
