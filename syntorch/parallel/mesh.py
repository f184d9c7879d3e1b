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

Expert parallelism re-factors each stage's ranks, as Megatron-Core's expert rank generator does
(parallel_state.initialize_model_parallel: the same order with tp -> etp, cp folded away, dp -> ep x
expert-dp): a stage's tp x cp x dp ranks, flattened in rank order (s = tp + tp_size * (cp + cp_size * dp)),
are also s = etp + etp_size * (ep + ep_size * expert_dp). So the expert-tensor group ("etp", --etp, the
experts' own TP size, default tp) is the first etp TP ranks, an EP group ("ep") the next ep of that order
-- what TP leaves (tp / etp), then CP, then DP: with CP the experts see the tokens of the CP x DP ranks --
and the expert-data-parallel group ("expert_dp": the replicas of one expert shard, which reduce its
gradients and over which FSDP shards it) the rest. With cp = 1 and etp = tp, EP is ep DP-neighbours and
expert-DP strides by ep along dp. The two factorings must nest: every boundary of one (tp, tp x cp; etp,
etp x ep) divides the next larger of the other, so each name is a run of "atoms" (size, stride) of one
common mixed radix, and `group`, `groups`, `index` and `translate` work on atoms alike for every name.
(Megatron-Core re-factors the whole world in its default order "tp-cp-ep-dp-pp", PP outermost, which is this
per-stage re-factoring; in a PP-inner order it requires expert-DP = DP. syntorch's DP is outside PP, so it
re-factors each stage's ranks.)

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
DENSE = ("tp", "cp", "dp")  # a stage's dimensions, innermost first
EXPERT = ("etp", "ep", "expert_dp")  # the same ranks as the experts see them
NAMES = (*DIMS, *EXPERT)


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
    ep: int = 1  # expert parallel: carved out of what etp leaves of a stage's TP x CP x DP ranks
    ring: bool = False  # interleaved pipeline: the last stage also sends to the first
    etp: int | None = None  # the experts' TP size (Megatron-Core's --expert-tensor-parallel-size), default tp

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for dim in (*DIMS, "ep", "etp"):
            size = getattr(self, dim)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise UserError(f"parallel degree --{dim} must be a positive integer, got {size!r}")
        if self.world_size > MAX_WORLD:
            raise UserError(f"{' * '.join(f'{d}({getattr(self, d)})' for d in reversed(DIMS))} = {self.world_size:,} "
                            f"ranks; syntorch models up to {MAX_WORLD:,}: lower the degrees")
        self._check_expert_split()

    def _check_expert_split(self) -> None:
        if self.tp % self.etp:
            raise UserError(f"--etp {self.etp} must divide --tp {self.tp}: an expert's tensor-parallel ranks are "
                            "part of one TP group here (Megatron-Core also allows larger; syntorch does not)")
        outer = self.tp // self.etp * self.cp * self.dp
        if outer % self.ep:
            over = " x ".join(f"{n}({s})" for n, s in (("tp/etp", self.tp // self.etp), ("cp", self.cp),
                                                      ("dp", self.dp)) if s > 1 or n == "dp")
            raise UserError(f"--ep {self.ep} must divide --dp {self.dp}: expert-parallel groups are made of the "
                            f"{over} = {outer} ranks of a stage that hold other tokens (Megatron-Core's layout)")
        bounds = sorted({*self._boundaries(DENSE), *self._boundaries(EXPERT)})
        for a, b in zip(bounds, bounds[1:]):
            if b % a:
                raise UserError(f"--ep {self.ep} x --etp {self.etp} = {self.ep * self.etp} and --tp {self.tp} x --cp "
                                f"{self.cp} = {self.tp * self.cp} must divide one another (the expert groups are "
                                "runs of a stage's ranks in Megatron-Core's order; syntorch needs them to nest)")

    def _boundaries(self, names) -> list[int]:
        """Where each of `names` starts in a stage's flattened order (and where the last ends)."""
        sizes = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "etp": self.etp, "ep": self.ep,
                 "expert_dp": self.expert_dp}
        out = [1]
        for name in names:
            out.append(out[-1] * sizes[name])
        return out

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def expert_dp(self) -> int:
        """The replicas of one expert shard: a stage's ranks over etp x ep."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

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
    def _atoms(self) -> list[tuple[int, int, int | None]]:
        """(size, stride, start) of each atom, innermost first: a stage's flattened order cut at every
        boundary of both factorings (module docstring), `start` where the atom begins in it, and the pp line
        (start None). A stage-local stride s is global s below tp x cp (TP and CP are innermost), s x pp above."""
        bounds = sorted({*self._boundaries(DENSE), *self._boundaries(EXPERT)})
        inner = self.tp * self.cp
        atoms = [(b // a, a if a < inner else a * self.pp, a) for a, b in zip(bounds, bounds[1:])]
        return sorted(atoms + [(self.pp, inner, None)] * (self.pp > 1), key=lambda atom: atom[1])

    @cached_property
    def _parts(self) -> dict[str, tuple[int, ...]]:
        """Name -> the indices of its atoms in _atoms."""
        parts = {"pp": tuple(i for i, atom in enumerate(self._atoms) if atom[2] is None)}
        for names in (DENSE, EXPERT):
            bounds = self._boundaries(names)
            for name, lo, hi in zip(names, bounds, bounds[1:]):
                parts[name] = tuple(i for i, (_, _, start) in enumerate(self._atoms)
                                    if start is not None and lo <= start < hi)
        return parts

    @cached_property
    def _dims(self) -> list[tuple[int, int]]:
        """(size, stride) of each of DIMS."""
        inner = self.tp * self.cp
        return [(self.tp, 1), (self.cp, self.tp), (self.pp, inner), (self.dp, inner * self.pp)]

    def _atoms_of(self, names) -> list[int]:
        for name in names:
            if name not in NAMES:
                raise ValueError(f"no mesh dimension {name!r}; the names are {', '.join(NAMES)}")
        return sorted({i for name in names for i in self._parts[name]})

    def lines(self, *names: str) -> list[tuple[int, int]]:
        """(size, stride) of each run of ranks `names` span (flattened), innermost first."""
        return [self._atoms[i][:2] for i in self._atoms_of(names)]

    def size(self, *names: str) -> int:
        """The ranks of one group along `names` (flattened): the product of their sizes."""
        return prod(size for size, _ in self.lines(*names))

    def stride(self, name: str) -> int:
        """How far apart in rank two neighbours along `name` are (its innermost atom's stride; of size 1,
        where it would start)."""
        lines = self.lines(name)
        if lines:
            return lines[0][1]
        if name in DIMS:
            return self._dims[DIMS.index(name)][1]
        start = self._boundaries(EXPERT)[EXPERT.index(name)]
        return start if start < self.tp * self.cp else start * self.pp

    def rank_of(self, **index: int) -> int:
        """The global rank at these indices (by dimension name; a missing one is 0)."""
        rank = 0
        for name, i in index.items():
            if not 0 <= i < self.size(name):
                raise ValueError(f"{name} index {i} is outside 0..{self.size(name) - 1}")
            for size, stride in self.lines(name):
                rank, i = rank + i % size * stride, i // size
        return rank

    def coordinate(self, rank: int) -> Coordinate:
        return Coordinate(*(rank // stride % size for size, stride in self._dims))

    def index(self, rank: int, *names: str) -> int:
        """`rank`'s place in its group along `names` (flattened, ranks in order): coordinate(rank).cp for
        "cp", the EP rank for "ep", dp * cp_size + cp for ("dp", "cp")."""
        place, scale = 0, 1
        for size, stride in self.lines(*names):
            place += rank // stride % size * scale
            scale *= size
        return place

    def first(self, rank: int, *names: str) -> int:
        """The lowest rank of `rank`'s group along `names`."""
        return rank - sum(rank // stride % size * stride for size, stride in self.lines(*names))

    def group(self, rank: int, *names: str) -> list[int]:
        """The ranks that differ from `rank` only along `names`, in rank order (a flattened view:
        `group(r, "dp", "cp")` is the DP x CP group)."""
        lines, first = self.lines(*names), self.first(rank, *names)
        return sorted(first + sum(i * stride for i, (_, stride) in zip(at, lines))
                      for at in product(*(range(size) for size, _ in lines)))

    def groups(self, *names: str) -> list[list[int]]:
        """Every group along `names`, ordered by their lowest rank (the ranks at 0 along `names`)."""
        mine = set(self._atoms_of(names))
        others = [atom[:2] for i, atom in enumerate(self._atoms) if i not in mine]
        firsts = sorted(sum(i * stride for i, (_, stride) in zip(at, others))
                        for at in product(*(range(size) for size, _ in others)))
        return [self.group(first, *names) for first in firsts]

    def dims_of(self, ranks) -> tuple[str, ...]:
        """The names `ranks` differ in, outermost first: ("dp", "cp") for a DP x CP group, ("ep",) or
        ("expert_dp",) for an expert group, () for one rank: the dimensions (else the expert names) whose
        atoms are exactly those the ranks differ in."""
        ranks = list(ranks)
        differ = {i for i, (size, stride, _) in enumerate(self._atoms)
                  if len({r // stride % size for r in ranks}) > 1}
        for names in (DIMS, (*EXPERT, "pp")):
            covered = [n for n in reversed(names) if self._parts[n] and set(self._parts[n]) <= differ]
            if {i for n in covered for i in self._parts[n]} == differ:
                return tuple(covered)
        coordinates = [self.coordinate(r) for r in ranks]
        return tuple(d for d in reversed(DIMS) if len({getattr(c, d) for c in coordinates}) > 1)

    def name(self, ranks) -> str:
        """What kind of group `ranks` form, as process_groups names them ("tp", "dp_cp", "ep", "model_parallel",
        "world"), "self" for one."""
        dims = self.dims_of(ranks)
        if len(dims) > 1 and set(dims) != {"dp", "cp"} and len(set(ranks)) == self.world_size:
            return "world"
        return "model_parallel" if set(dims) == {"tp", "pp"} else "_".join(dims) or "self"

    # --- the groups of a run and translation -------------------------------------------------------------

    @cache  # every rank of a symbolic run (init_groups) and the workload ask an equal mesh: made once
    def process_groups(self, tied: bool = False, rank: int | None = None) -> list[tuple[str, list[int]]]:
        """(kind, ranks) of every process group a run creates, in the order every rank must create them:
        "tp", "dp", with ep > 1 "ep" and "expert_dp", with cp > 1 "cp" and "dp_cp", then per PP chain its
        "stage_pair"s and, for a model whose head is tied to its embedding and pp > 1, the "embedding" pair
        of the first and last stage (Megatron's embedding group). `rank`: only those holding it, in that
        order (a symbolic run's, without building every group of a large world). Shared between callers:
        read, never change."""
        kinds = [("tp",), ("dp",)] + [("ep",), ("expert_dp",)] * (self.ep > 1) + [("cp",), ("dp", "cp")] * (self.cp > 1)
        every = self.groups if rank is None else lambda *names: [self.group(rank, *names)]
        groups = [("_".join(names), g) for names in kinds for g in every(*names)]
        for chain in every("pp"):
            groups += [("stage_pair", [a, b]) for a, b in zip(chain, chain[1:])]
            if self.ring and self.pp > 1:
                groups.append(("stage_pair", [chain[-1], chain[0]]))
            if tied and self.pp > 1:
                groups.append(("embedding", [chain[0], chain[-1]]))
        # the gradient norm's all-reduce (parallel/clip.py): over the model-parallel group (TP x PP), or over
        # every rank when the optimizer's state is sharded (ZeRO, FSDP) or experts differ across DP
        if self.tp * self.pp > 1:
            groups += [("model_parallel", g) for g in every("tp", "pp")]
        if self.dp * self.cp > 1:
            groups.append(("world", list(range(self.world_size))))
        return groups if rank is None else [(kind, g) for kind, g in groups if rank in g]

    def translate(self, rank: int, to_rank: int, back: bool = False) -> int:
        """The rank that plays, for `to_rank`, the part `rank` plays for its stage's representative (dp 0,
        cp 0, tp 0): moved along tp, cp and dp by to_rank's indices (`back`: against them), the stage kept.
        Ranks of a stage run the same program over groups that are such translations of each other (a CP
        rank's chunks differ in their positions, values a symbolic trace does not hold). Each atom moves on
        its own (no carry from one to the next), so expert groups, runs of atoms too, map onto such groups."""
        sign = -1 if back else 1
        moved = rank
        for size, stride, start in self._atoms:
            if start is not None:
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
    ep: object = None  # expert parallel: the ranks that split the experts (ep > 1)
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
    for kind, ranks in mesh.process_groups(tied, rank if only_mine else None):
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
