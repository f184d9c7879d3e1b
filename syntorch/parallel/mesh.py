"""The (dp, pp, tp) device mesh: which global rank does what, and every process group of a run.

Rank layout (Megatron's order, TP innermost so a TP group sits on one node's fast links):

    rank = ((dp_idx * pp) + pp_stage) * tp + tp_rank

so with dp=2, pp=2, tp=2: ranks 0,1 are TP group (dp 0, stage 0); 2,3 (dp 0, stage 1); 4,5 (dp 1, stage 0) ...
A TP group is tp consecutive ranks; a PP chain strides by tp; a DP group strides by pp * tp.

Expert parallelism splits the DP group, as Megatron-Core does (its expert rank order "tp-ep-dp-pp": EP inside
DP): the dp index is `outer * ep + ep_rank`, so an EP group is `ep` DP-neighbours (dp indices o*ep .. o*ep+ep-1)
and the expert-data-parallel group (the replicas of one expert, which reduce its gradients) strides by ep.

The groups a run creates, all from `Mesh.process_groups` (plans, the workload's comm groups and the collective
report read the same list): TP (sequence parallelism uses it too), DP (ZeRO shards over it), each pair of
neighbouring stages (pipeline send/recv), and the first/last-stage pair that shares a tied embedding.
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
    ep: int = 1  # expert parallel: divides dp (EP groups are made of DP ranks)

    def __post_init__(self):
        for dim in (*DIMS, "ep"):
            size = getattr(self, dim)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise UserError(f"parallel degree --{dim} must be a positive integer, got {size!r}")
        if self.dp % self.ep:
            raise UserError(f"--ep {self.ep} must divide --dp {self.dp}: expert-parallel groups are made of "
                            f"data-parallel ranks (Megatron's layout)")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def check_world_size(self, world_size: int) -> None:
        if world_size < 1:
            raise UserError(f"--world_size must be at least 1, got {world_size}")
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
        """Every group along `dim`, in a fixed order."""
        if dim == "tp":
            return [[self.rank(d, s, t) for t in range(self.tp)] for d in range(self.dp) for s in range(self.pp)]
        if dim == "dp":
            return [[self.rank(d, s, t) for d in range(self.dp)] for s in range(self.pp) for t in range(self.tp)]
        if dim in ("ep", "expert_dp"):  # sub-lines of the dp axis (module docstring)
            outer = self.dp // self.ep
            lines = ([[o * self.ep + e for e in range(self.ep)] for o in range(outer)] if dim == "ep" else
                     [[o * self.ep + e for o in range(outer)] for e in range(self.ep)])
            return [[self.rank(d, s, t) for d in line] for s in range(self.pp) for t in range(self.tp) for line in lines]
        return [[self.rank(d, s, t) for s in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def process_groups(self, tied: bool = False) -> list[tuple[str, list[int]]]:
        """(kind, ranks) of every process group a run creates, in the order every rank must create them:
        "tp", "dp", then per PP chain its "stage_pair"s and, for a model whose head is tied to its embedding
        and pp > 1, the "embedding" pair of the first and last stage (Megatron's embedding group)."""
        groups = [("tp", g) for g in self.groups("tp")] + [("dp", g) for g in self.groups("dp")]
        if self.ep > 1:
            groups += [("ep", g) for g in self.groups("ep")] + [("expert_dp", g) for g in self.groups("expert_dp")]
        for chain in self.groups("pp"):
            groups += [("stage_pair", [a, b]) for a, b in zip(chain, chain[1:])]
            if tied and self.pp > 1:
                groups.append(("embedding", [chain[0], chain[-1]]))
        return groups

    def translate(self, rank: int, to_rank: int) -> int:
        """The rank that plays, for `to_rank`, the part `rank` plays for its stage's representative (dp 0,
        tp 0): shifted along dp and tp by to_rank's coordinates, the stage kept. Ranks of a stage run the
        same program over groups that are such translations of each other."""
        d, s, t = self.coords(rank)
        to_d, _, to_t = self.coords(to_rank)
        # dp = outer * ep + ep_rank: each part moves on its own, so EP and expert-DP groups map onto such groups
        (o, e), (to_o, to_e) = divmod(d, self.ep), divmod(to_d, self.ep)
        d = (o + to_o) % (self.dp // self.ep) * self.ep + (e + to_e) % self.ep
        return self.rank(d, s, (t + to_t) % self.tp)

    def ep_rank(self, rank: int) -> int:
        return self.coords(rank)[0] % self.ep

    def representative(self, stage: int) -> int:
        return self.rank(0, stage, 0)


@dataclass
class MeshGroups:
    """This rank's place in the mesh and its process groups (torch ProcessGroups; None where it has none)."""
    mesh: Mesh
    rank: int
    tp: object = None
    dp: object = None
    prev: object = None  # the pair with the previous stage, and its global rank
    prev_rank: int | None = None
    next: object = None  # the pair with the next stage
    next_rank: int | None = None
    embedding: object = None  # the first/last-stage pair of a tied embedding, on those stages
    ep: object = None  # expert parallel: the DP ranks that split the experts (ep > 1)
    expert_dp: object = None  # the ranks holding the same experts, which reduce their gradients (ep > 1)

    @property
    def tp_rank(self) -> int:
        return self.mesh.coords(self.rank)[2]

    @property
    def stage(self) -> int:
        return self.mesh.coords(self.rank)[1]


def init_groups(mesh: Mesh, tied: bool = False, only_mine: bool = False) -> MeshGroups:
    """Create every process group of `mesh` (collective: every rank calls it) and return this rank's.

    The default process group must be up (launch.init_distributed or comm.symbolic_world). `only_mine`
    (symbolic runs, no peers to agree with) creates just the groups this rank is in, so 8192 ranks cost
    what one rank needs.
    """
    mesh.check_world_size(dist.get_world_size())
    rank = dist.get_rank()
    mine = MeshGroups(mesh, rank)
    for kind, ranks in mesh.process_groups(tied):
        if rank not in ranks and only_mine:
            continue
        group = dist.new_group(ranks)
        if rank not in ranks:
            continue
        if kind in ("tp", "dp", "embedding", "ep", "expert_dp"):
            setattr(mine, kind, group)
        elif ranks[1] == rank:
            mine.prev, mine.prev_rank = group, ranks[0]
        else:
            mine.next, mine.next_rank = group, ranks[1]
    return mine
