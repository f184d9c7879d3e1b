"""The named device mesh: which global rank does what, and every process group of a run.

One order, Megatron's "tp-cp-pp-dp" (DIMS, innermost first): TP innermost so a TP group sits on one node's
fast links, then CP, PP and DP, as Megatron-LM's parallel_state orders them:

    rank = ((dp * pp_size + pp) * cp_size + cp) * tp_size + tp

so a TP group is tp consecutive ranks, a CP group strides by tp, a PP chain by cp * tp and a DP group by
pp * cp * tp (Mesh.stride). With dp=2, pp=2, tp=2 (cp=1): ranks 0,1 are the TP group of (dp 0, stage 0);
2,3 (dp 0, stage 1); 4,5 (dp 1, stage 0) ...

Ranks and groups are asked for by name only, as torchtitan's ParallelDims/DeviceMesh does: `rank_of(dp=1,
tp=1)`, `coordinate(rank).cp`, `group(rank, "dp", "cp")` (a flattened view: the ranks that differ from
`rank` only along dp and cp, the group gradients are averaged over with context parallelism), `groups("tp")`.

Expert parallelism splits the DP dimension, as Megatron-Core does (its expert rank order "tp-ep-dp-pp": EP
inside DP): dp = expert_dp * ep + ep_index, so an EP group ("ep") is `ep` DP-neighbours (dp indices o*ep ..
o*ep+ep-1) and the expert-data-parallel group ("expert_dp": the replicas of one expert, which reduce its
gradients) strides by ep along dp. Both are names `group` and `groups` take like the four dimensions.

The groups a run creates, all from `Mesh.process_groups` (plans, the workload's comm groups and the collective
report read the same list): TP (sequence parallelism uses it too), DP (ZeRO shards over it), with cp > 1 CP
(K/V all-gathers) and DP x CP ("dp_cp", Megatron's data-parallel-with-context-parallel group), with ep > 1
EP (all-to-all of routed tokens) and expert-DP, each pair of neighbouring stages (pipeline send/recv; with
`ring`, also the last stage to the first, the link an interleaved pipeline's chunks wrap around), the
first/last-stage pair that shares a tied embedding, and the model-parallel groups (TP x PP) and the world,
over which the gradient norm is summed.
"""
from dataclasses import asdict, dataclass
from functools import cache, cached_property
from itertools import product
from math import prod
from typing import NamedTuple

import torch.distributed as dist

from syntorch.errors import UserError

ORDER = "tp-cp-pp-dp"  # Megatron's name for the layout, innermost first
DIMS = tuple(ORDER.split("-"))
AXES = ("tp", "cp", "pp", "ep", "expert_dp")  # DIMS with dp as its two parts, innermost first
PARTS = {**{a: (a,) for a in AXES}, "dp": ("ep", "expert_dp")}  # each name as the axes it spans


@cache
def _axes_of(names: tuple[str, ...]) -> tuple[str, ...]:
    """The axes `names` span, innermost first."""
    for name in names:
        if name not in PARTS:
            raise ValueError(f"no mesh dimension {name!r}; the names are {', '.join(PARTS)}")
    return tuple(a for a in AXES if any(a in PARTS[n] for n in names))


class Coordinate(NamedTuple):
    """A rank's index along each dimension (fields in DIMS order; read them by name)."""
    tp: int
    cp: int
    pp: int
    dp: int


MAX_WORLD = 2**20  # 1,048,576 ranks: ten times today's largest clusters; beyond, the mesh's groups fill memory


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """The degrees by name (keywords only; fields in DIMS order)."""
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
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
        if self.world_size > MAX_WORLD:
            raise UserError(f"{' * '.join(f'{d}({getattr(self, d)})' for d in reversed(DIMS))} = {self.world_size:,} "
                            f"ranks; syntorch models up to {MAX_WORLD:,}: lower the degrees")

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

    def to_json(self) -> dict:
        """Every field by name (`Mesh(**that)` builds it again)."""
        return asdict(self)

    # --- names to ranks -------------------------------------------------------------------------------

    @cached_property
    def _axes(self) -> dict[str, tuple[int, int]]:
        """Axis (AXES) -> (size, stride)."""
        dp_stride = self.tp * self.cp * self.pp
        return {"tp": (self.tp, 1), "cp": (self.cp, self.tp), "pp": (self.pp, self.tp * self.cp),
                "ep": (self.ep, dp_stride), "expert_dp": (self.dp // self.ep, dp_stride * self.ep)}

    @cached_property
    def _dims(self) -> list[tuple[int, int]]:
        """(size, stride) of each of DIMS."""
        return [(self.dp, self._axes["ep"][1]) if d == "dp" else self._axes[d] for d in DIMS]

    def _lines(self, names) -> list[tuple[int, int]]:
        return [self._axes[a] for a in _axes_of(names)]

    def size(self, *names: str) -> int:
        """The ranks of one group along `names` (flattened): the product of their sizes."""
        return prod(size for size, _ in self._lines(names))

    def stride(self, name: str) -> int:
        """How far apart in rank two neighbours along `name` are."""
        return self._lines((name,))[0][1]

    def rank_of(self, **index: int) -> int:
        """The global rank at these indices (by dimension name; a missing one is 0)."""
        for name, i in index.items():
            if not 0 <= i < self.size(name):
                raise ValueError(f"{name} index {i} is outside 0..{self.size(name) - 1}")
        return sum(i * self.stride(name) for name, i in index.items())

    def coordinate(self, rank: int) -> Coordinate:
        return Coordinate(*(rank // stride % size for size, stride in self._dims))

    def index(self, rank: int, *names: str) -> int:
        """`rank`'s place in its group along `names` (flattened, ranks in order): coordinate(rank).cp for
        "cp", the EP rank for "ep", dp * cp_size + cp for ("dp", "cp")."""
        place, scale = 0, 1
        for size, stride in self._lines(names):
            place += rank // stride % size * scale
            scale *= size
        return place

    def first(self, rank: int, *names: str) -> int:
        """The lowest rank of `rank`'s group along `names`."""
        return rank - sum(rank // stride % size * stride for size, stride in self._lines(names))

    def group(self, rank: int, *names: str) -> list[int]:
        """The ranks that differ from `rank` only along `names`, in rank order (a flattened view:
        `group(r, "dp", "cp")` is the DP x CP group)."""
        lines, first = self._lines(names), self.first(rank, *names)
        return sorted(first + sum(i * stride for i, (_, stride) in zip(at, lines))
                      for at in product(*(range(size) for size, _ in lines)))

    def groups(self, *names: str) -> list[list[int]]:
        """Every group along `names`, ordered by their lowest rank (the ranks at 0 along `names`)."""
        firsts = self.group(0, *(a for a in AXES if a not in _axes_of(names)))
        return [self.group(first, *names) for first in firsts]

    def dims_of(self, ranks) -> tuple[str, ...]:
        """The names `ranks` differ in, outermost first: ("dp", "cp") for a DP x CP group, ("ep",) or
        ("expert_dp",) for part of a DP line, () for one rank."""
        coordinates = [self.coordinate(r) for r in ranks]
        differ = [d for d in reversed(DIMS) if len({getattr(c, d) for c in coordinates}) > 1]
        if "dp" in differ and len({c.dp for c in coordinates}) < self.dp:
            differ[differ.index("dp")] = "ep" if len({self.index(r, "expert_dp") for r in ranks}) == 1 else "expert_dp"
        return tuple(differ)

    def name(self, ranks) -> str:
        """What kind of group `ranks` form, as process_groups names them ("tp", "dp_cp", "ep", "model_parallel",
        "world"), "self" for one."""
        dims = self.dims_of(ranks)
        if len(dims) > 1 and set(dims) != {"dp", "cp"} and len(set(ranks)) == self.world_size:
            return "world"
        return "model_parallel" if set(dims) == {"tp", "pp"} else "_".join(dims) or "self"

    # --- the groups of a run and translation -------------------------------------------------------------

    def process_groups(self, tied: bool = False) -> list[tuple[str, list[int]]]:
        """(kind, ranks) of every process group a run creates, in the order every rank must create them:
        "tp", "dp", with ep > 1 "ep" and "expert_dp", with cp > 1 "cp" and "dp_cp", then per PP chain its
        "stage_pair"s and, for a model whose head is tied to its embedding and pp > 1, the "embedding" pair
        of the first and last stage (Megatron's embedding group)."""
        kinds = [("tp",), ("dp",)] + [("ep",), ("expert_dp",)] * (self.ep > 1) + [("cp",), ("dp", "cp")] * (self.cp > 1)
        groups = [("_".join(names), g) for names in kinds for g in self.groups(*names)]
        for chain in self.groups("pp"):
            groups += [("stage_pair", [a, b]) for a, b in zip(chain, chain[1:])]
            if self.ring and self.pp > 1:
                groups.append(("stage_pair", [chain[-1], chain[0]]))
            if tied and self.pp > 1:
                groups.append(("embedding", [chain[0], chain[-1]]))
        # the gradient norm's all-reduce (parallel/clip.py): over the model-parallel group (TP x PP), or over
        # every rank when the optimizer's state is sharded (ZeRO, FSDP) or experts differ across DP
        if self.tp * self.pp > 1:
            groups += [("model_parallel", g) for g in self.groups("tp", "pp")]
        if self.dp * self.cp > 1:
            groups.append(("world", list(range(self.world_size))))
        return groups

    def translate(self, rank: int, to_rank: int, back: bool = False) -> int:
        """The rank that plays, for `to_rank`, the part `rank` plays for its stage's representative (dp 0,
        cp 0, tp 0): moved along tp, cp and dp by to_rank's indices (`back`: against them), the stage kept.
        Ranks of a stage run the same program over groups that are such translations of each other (a CP
        rank's chunks differ in their positions, values a symbolic trace does not hold). dp moves as its
        two parts, each on its own, so EP and expert-DP groups map onto such groups."""
        sign = -1 if back else 1
        moved = rank
        for a, (size, stride) in self._axes.items():
            if a != "pp":
                i = rank // stride % size
                moved += ((i + sign * (to_rank // stride % size)) % size - i) * stride
        return moved

    def representative(self, stage: int) -> int:
        return self.rank_of(pp=stage)

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks of pipeline stage `stage` (they run one program, translations of its representative's)."""
        return self.group(self.representative(stage), "dp", "cp", "tp")


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
        return self.mesh.coordinate(self.rank).tp

    @property
    def cp_rank(self) -> int:
        return self.mesh.coordinate(self.rank).cp

    @property
    def grad_group(self):
        """Where gradients are averaged (and ZeRO/FSDP shard): DP, or DP x CP with context parallelism."""
        return self.dp_cp if self.mesh.cp > 1 else self.dp

    @property
    def stage(self) -> int:
        return self.mesh.coordinate(self.rank).pp


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
