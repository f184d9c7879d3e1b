"""The (dp, pp, cp, tp) device mesh: which global rank does what, and every process group of a run.

Rank layout (Megatron's order "tp-cp-pp-dp": TP innermost so a TP group sits on one node's fast links, CP
next, as Megatron-LM's parallel_state orders them):

    rank = (((dp_idx * pp) + pp_stage) * cp + cp_rank) * tp + tp_rank

so with dp=2, pp=2, tp=2 (cp=1): ranks 0,1 are TP group (dp 0, stage 0); 2,3 (dp 0, stage 1); 4,5 (dp 1,
stage 0) ... A TP group is tp consecutive ranks; a CP group strides by tp; a PP chain by cp * tp; a DP
group by pp * cp * tp. With cp=1 the layout is the (dp, pp, tp) one of earlier releases, rank for rank.

Expert parallelism splits the DP group, as Megatron-Core does (its expert rank order "tp-ep-dp-pp": EP inside
DP): the dp index is `outer * ep + ep_rank`, so an EP group is `ep` DP-neighbours (dp indices o*ep .. o*ep+ep-1)
and the expert-data-parallel group (the replicas of one expert, which reduce its gradients) strides by ep.

The groups a run creates, all from `Mesh.process_groups` (plans, the workload's comm groups and the collective
report read the same list): TP (sequence parallelism uses it too), DP (ZeRO shards over it), with cp > 1 CP
(K/V all-gathers) and DP x CP (gradients are averaged over every rank that saw part of the batch, as
Megatron's data-parallel-with-context-parallel group), with ep > 1 EP (all-to-all of routed tokens) and
expert-DP, each pair of neighbouring stages (pipeline send/recv; with `ring`, also the last stage to the
first, the link an interleaved pipeline's chunks wrap around), the first/last-stage pair that shares a
tied embedding, and the model-parallel groups (TP x PP) and the world, over which the gradient norm is summed.
"""
from dataclasses import dataclass

import torch.distributed as dist

from syntorch.errors import UserError

DIMS = ("dp", "pp", "cp", "tp")  # outermost first


@dataclass(frozen=True)
class Mesh:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallel: divides dp (EP groups are made of DP ranks)
    ring: bool = False  # interleaved pipeline: the last stage also sends to the first

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
        return self.dp * self.pp * self.cp * self.tp

    def check_world_size(self, world_size: int) -> None:
        if world_size < 1:
            raise UserError(f"--world_size must be at least 1, got {world_size}")
        if world_size != self.world_size:
            cp = f" * cp({self.cp})" if self.cp > 1 else ""
            raise UserError(f"dp({self.dp}) * pp({self.pp}){cp} * tp({self.tp}) = {self.world_size} "
                            f"but the world has {world_size} ranks; make the product equal the rank count")

    def rank(self, dp_idx: int, pp_stage: int, tp_rank: int, cp_rank: int = 0) -> int:
        return self.at(dp=dp_idx, pp=pp_stage, cp=cp_rank, tp=tp_rank)

    def at(self, **index: int) -> int:
        """The global rank at these indices along DIMS (a missing one is 0)."""
        rank = 0
        for dim in DIMS:
            rank = rank * getattr(self, dim) + index.get(dim, 0)
        return rank

    def position(self, rank: int) -> tuple[int, ...]:
        """The indices of a global rank along DIMS: (dp_idx, pp_stage, cp_rank, tp_rank)."""
        index = []
        for dim in reversed(DIMS):
            rank, i = divmod(rank, getattr(self, dim))
            index.append(i)
        return tuple(reversed(index))

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_idx, pp_stage, tp_rank) of a global rank (its cp_rank: `position`)."""
        d, s, _, t = self.position(rank)
        return d, s, t

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """The global ranks of `rank`'s group along `dim` (the ranks that differ from it only in that index)."""
        index = dict(zip(DIMS, self.position(rank)))
        return [self.at(**{**index, dim: i}) for i in range(getattr(self, dim))]

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along `dim`, in a fixed order (the other indices outermost first, as DIMS)."""
        if dim in ("ep", "expert_dp"):  # sub-lines of the dp axis (module docstring)
            outer = self.dp // self.ep
            lines = ([[o * self.ep + e for e in range(self.ep)] for o in range(outer)] if dim == "ep" else
                     [[o * self.ep + e for o in range(outer)] for e in range(self.ep)])
            return [[self.at(dp=d, pp=s, cp=c, tp=t) for d in line]
                    for s in range(self.pp) for c in range(self.cp) for t in range(self.tp) for line in lines]
        return [self.group_ranks(dim, r) for r in range(self.world_size) if self.position(r)[DIMS.index(dim)] == 0]

    def dp_cp_groups(self) -> list[list[int]]:
        """The ranks that differ only in their dp and cp indices: where gradients are averaged."""
        return [[r for d in self.group_ranks("dp", first) for r in self.group_ranks("cp", d)]
                for first in self.world_ranks(dp=0, cp=0)]

    def world_ranks(self, **fixed: int) -> list[int]:
        """The global ranks whose indices equal `fixed`, in rank order."""
        return [r for r in range(self.world_size)
                if all(self.position(r)[DIMS.index(dim)] == i for dim, i in fixed.items())]

    def process_groups(self, tied: bool = False) -> list[tuple[str, list[int]]]:
        """(kind, ranks) of every process group a run creates, in the order every rank must create them:
        "tp", "dp", with cp > 1 "cp" and "dp_cp", then per PP chain its "stage_pair"s and, for a model whose
        head is tied to its embedding and pp > 1, the "embedding" pair of the first and last stage (Megatron's
        embedding group)."""
        groups = [("tp", g) for g in self.groups("tp")] + [("dp", g) for g in self.groups("dp")]
        if self.ep > 1:
            groups += [("ep", g) for g in self.groups("ep")] + [("expert_dp", g) for g in self.groups("expert_dp")]
        if self.cp > 1:
            groups += [("cp", g) for g in self.groups("cp")] + [("dp_cp", g) for g in self.dp_cp_groups()]
        for chain in self.groups("pp"):
            groups += [("stage_pair", [a, b]) for a, b in zip(chain, chain[1:])]
            if self.ring and self.pp > 1:
                groups.append(("stage_pair", [chain[-1], chain[0]]))
            if tied and self.pp > 1:
                groups.append(("embedding", [chain[0], chain[-1]]))
        # the gradient norm's all-reduce (parallel/clip.py): over the model-parallel group (TP x PP), or over
        # every rank when the optimizer's state is sharded (ZeRO, FSDP) or experts differ across DP
        if self.tp * self.pp > 1:
            groups += [("model_parallel", self.world_ranks(dp=d, cp=c)) for d in range(self.dp) for c in range(self.cp)]
        if self.dp * self.cp > 1:
            groups.append(("world", list(range(self.world_size))))
        return groups

    def translate(self, rank: int, to_rank: int) -> int:
        """The rank that plays, for `to_rank`, the part `rank` plays for its stage's representative (dp 0,
        cp 0, tp 0): shifted along dp, cp and tp by to_rank's indices, the stage kept. Ranks of a stage run
        the same program over groups that are such translations of each other (a CP rank's chunks differ in
        their positions, values a symbolic trace does not hold)."""
        index, by = self.position(rank), self.position(to_rank)
        moved = {dim: i if dim == "pp" else (i + j) % getattr(self, dim) for dim, i, j in zip(DIMS, index, by)}
        # dp = outer * ep + ep_rank: each part moves on its own, so EP and expert-DP groups map onto such groups
        (o, e), (to_o, to_e) = divmod(index[0], self.ep), divmod(by[0], self.ep)
        moved["dp"] = (o + to_o) % (self.dp // self.ep) * self.ep + (e + to_e) % self.ep
        return self.at(**moved)

    def ep_rank(self, rank: int) -> int:
        return self.coords(rank)[0] % self.ep

    def representative(self, stage: int) -> int:
        return self.at(pp=stage)


@dataclass
class MeshGroups:
    """This rank's place in the mesh and its process groups (torch ProcessGroups; None where it has none)."""
    mesh: Mesh
    rank: int
    tp: object = None
    dp: object = None
    cp: object = None  # with cp > 1: the CP group and the DP x CP group gradients are averaged over
    dp_cp: object = None
    prev: object = None  # the pair with the previous stage, and its global rank
    prev_rank: int | None = None
    next: object = None  # the pair with the next stage
    next_rank: int | None = None
    embedding: object = None  # the first/last-stage pair of a tied embedding, on those stages
    ep: object = None  # expert parallel: the DP ranks that split the experts (ep > 1)
    expert_dp: object = None  # the ranks holding the same experts, which reduce their gradients (ep > 1)
    model_parallel: object = None  # TP x PP: the ranks that hold one replica of the model (tp * pp > 1)
    world: object = None  # every rank (dp * cp > 1)

    @property
    def tp_rank(self) -> int:
        return self.mesh.coords(self.rank)[2]

    @property
    def cp_rank(self) -> int:
        return self.mesh.position(self.rank)[DIMS.index("cp")]

    @property
    def grad_group(self):
        """Where gradients are averaged (and ZeRO/FSDP shard): DP, or DP x CP with context parallelism."""
        return self.dp_cp if self.mesh.cp > 1 else self.dp

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
        if kind in ("tp", "dp", "cp", "dp_cp", "embedding", "ep", "expert_dp", "model_parallel", "world"):
            setattr(mine, kind, group)
        elif ranks[1] == rank:
            mine.prev, mine.prev_rank = group, ranks[0]
        else:
            mine.next, mine.next_rank = group, ranks[1]
    return mine
