"""A stated routing load for symbolic MoE runs (`--moe_load`): each expert's share of the routed (token, expert)
pairs, per MoE layer. A symbolic run has no router values to route by; it assumes this load on every rank.

- `uniform` (the default): every expert 1/E in every layer.
- `zipf:S` (S >= 0): expert e's share proportional to 1 / (e + 1)^S in every layer, a one-parameter skew
  (0 is uniform; the larger S, the more the low-numbered experts get).
- `FILE.json`: {"tokens_per_expert": [[n_0, ..., n_{E-1}], ...]}, one row per MoE layer in model order (layers
  before `first_k_dense` are dense and have none), counts or shares; each row is normalised to shares.

The plan holds the load (TrainPlan.moe_load: a tuple of E shares per MoE layer) and sets each MoE layer's
share list (MoE.symbolic_load), which MoE.tokens_per_expert rounds into counts on meta. Under expert
parallelism every rank routes alike, so an EP rank receives, from each rank of its EP group, its own experts'
share of the pairs, and computes its experts on them (expert.py): ranks holding busier experts move and
compute more. Which EP ranks run the same program follows from the shares of the experts each holds, layer
by layer (`ep_kinds`); under a uniform load, one kind. `RankKinds` names, per pipeline stage, the ranks of
each kind and the one traced for it (syntorch trace traces one rank per stage and kind and translates it to
the others of its kind, workload.py).
"""
import math

from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.models import LAYER_PATH
from syntorch.models.moe import MoE
from syntorch.userfiles import read_json

Load = tuple[tuple[float, ...], ...]


def moe_layers(config: ModelConfig) -> int:
    """How many of the model's layers are MoE layers (models/gpt.py: all but the first `first_k_dense`)."""
    return config.n_layer - config.first_k_dense if config.n_experts else 0


def parse_load(spec: str | None, config: ModelConfig) -> Load | None:
    """--moe_load's value as a plan's load (None: uniform); one line naming what is wrong otherwise."""
    if spec in (None, "uniform"):
        return None
    if not config.n_experts:
        raise UserError(f"--moe_load states how tokens are routed to experts; {config.name} has none, drop it")
    if spec.startswith("zipf:"):
        try:
            skew = float(spec[len("zipf:"):])
        except ValueError:
            skew = -1.0
        if not skew >= 0 or math.isinf(skew):
            raise UserError(f"--moe_load zipf:S takes a skew S >= 0 (0: uniform), got {spec!r}")
        row = _shares([1 / (e + 1) ** skew for e in range(config.n_experts)])
        return (row,) * moe_layers(config)
    data = read_json(spec, "--moe_load file")
    rows = data.get("tokens_per_expert") if isinstance(data, dict) and set(data) == {"tokens_per_expert"} else None
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise UserError(f"--moe_load file {spec} must hold {{\"tokens_per_expert\": [[one number per expert], one "
                        "row per MoE layer]}} and nothing else")
    load = tuple(_row(row, i, spec) for i, row in enumerate(rows))
    check_load(config, load, spec)
    return load


def _row(row: list, layer: int, where: str) -> tuple[float, ...]:
    numbers = all(isinstance(n, (int, float)) and not isinstance(n, bool) and 0 <= n < math.inf for n in row)
    if not numbers or not any(row):
        raise UserError(f"--moe_load {where}: MoE layer {layer}'s row must be non-negative numbers, not all zero")
    return _shares(row)


def _shares(row) -> tuple[float, ...]:
    total = sum(row)
    return tuple(n / total for n in row)


def check_load(config: ModelConfig, load: Load | None, where: str = "") -> None:
    """A load has one row of E shares per MoE layer of the model."""
    if load is None:
        return
    where = f" {where}" if where else ""
    layers, experts = moe_layers(config), config.n_experts
    if len(load) != layers:
        raise UserError(f"--moe_load{where} has {len(load)} rows but {config.name} has {layers} MoE layers "
                        f"(layers {config.first_k_dense}..{config.n_layer - 1}); give one row per MoE layer")
    for i, row in enumerate(load):
        if len(row) != experts:
            raise UserError(f"--moe_load{where}: MoE layer {i}'s row has {len(row)} experts but {config.name} has "
                            f"{experts}")


def set_load(model, load: Load | None) -> None:
    """Each MoE layer of `model` (a stage's: layer names keep their global index) assumes its row."""
    if load is None:
        return
    first = model.config.first_k_dense
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            module.symbolic_load = list(load[int(LAYER_PATH.match(name).group(1)) - first])


def ep_kinds(load: Load | None, ep: int) -> list[list[int]]:
    """EP indices grouped by the shares of the experts each holds, layer by layer, in order of their first
    index: ranks of one group receive and compute alike (module docstring)."""
    if load is None:
        return [list(range(ep))]
    per_rank = len(load[0]) // ep
    kinds: dict[tuple, list[int]] = {}
    for i in range(ep):
        kinds.setdefault(tuple(row[i * per_rank:(i + 1) * per_rank] for row in load), []).append(i)
    return list(kinds.values())


class RankKinds:
    """The rank kinds of a mesh's stages, from `groups` (ep_kinds: EP indices that run alike): ranks whose EP
    indices are of one group run one program, translations of its representative's (the kind's lowest rank:
    dp 0, cp 0, tp 0 but for its EP index, which mesh.translate moves onto the kind's others). Kind 0 holds the
    stage's representative (EP index 0)."""

    def __init__(self, mesh, groups: list[list[int]] | None = None):
        self.mesh, self.groups = mesh, groups or [list(range(mesh.ep))]
        self.count = len(self.groups)
        self.of_index = [0] * mesh.ep
        for kind, group in enumerate(self.groups):
            for i in group:
                self.of_index[i] = kind

    @property
    def p2p_all_to_all(self) -> bool:
        """Whether the Chakra files write each all-to-all as the sends and recvs of each pair's bytes: under a
        load that makes kinds of one EP index each (translation moves a kind's ranks only along the other
        dimensions, so every rank of a kind keeps its pairs' sizes). Kinds of several EP indices keep
        ALL_TO_ALL nodes of unequal sizes, which ASTRA-sim cannot run (syntorch validate names them)."""
        return self.count > 1 and all(len(g) == 1 for g in self.groups)

    def of(self, rank: int) -> int:
        return self.of_index[self.mesh.index(rank, "ep")] if self.count > 1 else 0

    def representative(self, stage: int, kind: int) -> int:
        return self.mesh.rank_of(pp=stage, ep=self.groups[kind][0])

    def ranks(self, kind: int) -> int:
        """How many ranks of a stage are of `kind`."""
        return self.mesh.world_size // self.mesh.pp // self.mesh.ep * len(self.groups[kind])


def rank_kinds(mesh, load: Load | None) -> RankKinds:
    """The rank kinds `load` makes of `mesh`'s stages."""
    return RankKinds(mesh, ep_kinds(load, mesh.ep))
