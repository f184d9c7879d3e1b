"""The collective report: a view of a TraceGraph by module, as torch's CommDebugMode reports a run
(syntorch/comm_debug.py is that API on a live run; `syntorch comm` reads a saved trace; export/comm_report.py
writes the table, JSON and browser view).

Meanings follow torch: counts per module include the module's descendants, "Global" holds everything, and the
sections are FORWARD PASS / BACKWARD PASS (phases prefill and decode[i] are forward; an OPTIMIZER STEP section
holds phase "optimizer"). Noise levels, as the tutorial defines them:
  0  module-level collective counts
  1  + module info (type, parameters and their local shards), collectives one by one, and the ops that read a
     (sharded) parameter -- the syntorch analogue of torch's "DTensor ops" -- without trivial ops
  2  + every tensor-level op except trivial ones
  3  everything
Beyond torch: each collective's bytes, group (global ranks), reduce op, order in its group and p2p peers, and
byte totals per module and per phase.

Identical consecutive decode steps are listed once (`step_runs`, `fold_steps`) by the table and the browser
view, as the images draw them once: steps with the same ops and collectives in the same modules and order,
the same parameters, and collectives of the same kind, bytes, group and peers (their order and p2p tag go
on counting); input shapes may differ only in entries that grow by one a step (the KV length). Counts and
bytes still count every step; the JSON dump keeps every op.
"""
from collections import Counter
from dataclasses import dataclass, field

from syntorch.errors import UserError
from syntorch.trace.graph import COLLECTIVES
from syntorch.trace.folds import grown_entries, step_index

NOISE_LEVELS = (0, 1, 2, 3)
SECTIONS = ("forward", "backward", "optimizer")
GLOBAL = "Global"  # torch's name for the root of the module tree
# torch's trivial_ops, by op packet (the overload is dropped so "aten.t" and "aten.t.default" both match)
TRIVIAL_OPS = frozenset({"aten.detach", "aten.t", "aten.view", "aten._to_copy", "aten.as_strided",
                         "aten.transpose"})
CONTAINER_TYPES = frozenset(f"torch.nn.modules.container.{name}" for name in
                            ("ModuleDict", "ModuleList", "ParameterDict", "ParameterList"))
COLLECTIVE_FIELDS = ("collective", "reduce_op", "bytes", "group", "order", "src", "dst", "tag")
RUNNING = ("order", "tag")  # counts that go on from step to step: the order in a group, a p2p message's number


def check_noise_level(noise_level, flag: str = "noise level") -> int:
    """The level as an int; `flag` names it in the message (--comm_debug, --noise_level)."""
    if isinstance(noise_level, bool) or noise_level not in NOISE_LEVELS:
        raise UserError(f"{flag} must be 0, 1, 2 or 3, got {noise_level!r}")
    return int(noise_level)


def section_of(phase: str) -> str:
    return phase if phase in ("backward", "optimizer") else "forward"


def is_trivial(op_name: str) -> bool:
    return op_name in TRIVIAL_OPS or op_name.rsplit(".", 1)[0] in TRIVIAL_OPS


@dataclass
class OpRecord:
    """One op or collective, as the report lists it under the module that issued it."""
    node: int
    name: str
    kind: str  # "op" | "collective"
    phase: str
    input_shapes: list
    params: list  # names of the parameters it reads, directly or through views of them
    collective: dict = field(default_factory=dict)  # COLLECTIVE_FIELDS, for collectives

    @property
    def section(self) -> str:
        return section_of(self.phase)

    def visible_at(self, noise_level: int) -> bool:
        if noise_level >= 3:
            return True
        if noise_level == 0 or is_trivial(self.name):
            return False
        return noise_level == 2 or self.kind == "collective" or bool(self.params)


@dataclass
class ModuleInfo:
    fqn: str  # "" for Global
    depth: int = 0  # in the tree as shown (containers that never run, like ModuleDict, are left out)
    module_type: str = ""
    parameters: dict = field(default_factory=dict)  # name -> {"shape", "dtype"} of this rank's shard
    children: list = field(default_factory=list)
    records: list = field(default_factory=list)  # ops and collectives issued here (not in children)
    # section -> collective kind -> [count, bytes], this module and its descendants (torch's meaning)
    totals: dict = field(default_factory=lambda: {s: {} for s in SECTIONS})

    @property
    def name(self) -> str:
        return self.fqn or GLOBAL

    def add_collective(self, section: str, kind: str, nbytes: int):
        count_bytes = self.totals[section].setdefault(kind, [0, 0])
        count_bytes[0] += 1
        count_bytes[1] += nbytes


class CommReport:
    """What CommDebugMode knows about one rank's run, read from its TraceGraph."""

    def __init__(self, graph):
        self.graph_attrs = dict(graph.graph)
        self.modules: dict[str, ModuleInfo] = {"": ModuleInfo("")}
        self.collectives: list[dict] = []
        self.phase_totals: dict[str, dict] = {}  # phase -> kind -> [count, bytes], in traced order
        self._read(graph)
        for fqn, module_type in (graph.graph.get("module_types") or {}).items():  # CommDebugMode records them
            if fqn in self.modules:
                self.modules[fqn].module_type = module_type
        self._drop_containers()
        self.step_runs = self._step_runs()  # {first step: the steps listed as one}, runs of two or more

    # --- reading the graph ----------------------------------------------------------------------
    def _read(self, graph):
        param_derived = {}  # tensor node -> parameter name, for parameters and views of them
        for node, data in sorted(graph.nodes(data=True)):
            if data["kind"] == "tensor":
                if data.get("is_param"):
                    param_derived[node] = data["name"]
                    self._add_parameter(data)
                continue
            inputs = [t for t, _, _ in sorted(graph.in_edges(node, data="arg"), key=lambda e: e[2])]
            params = sorted({param_derived[t] for t in inputs if t in param_derived})
            if data.get("is_view") and params:
                param_derived.update((t, params[0]) for t in graph.successors(node))
            record = OpRecord(node, data["name"], data["kind"], data.get("phase", "forward"),
                              [list(graph.nodes[t].get("shape", [])) for t in inputs], params)
            self._module(data.get("module", "")).records.append(record)
            if record.kind == "collective":
                self._add_collective(record, data)

    def _module(self, fqn: str) -> ModuleInfo:
        """The module's entry, creating it and its missing parents (so parents come before children)."""
        if fqn not in self.modules:
            parent = self._module(fqn.rsplit(".", 1)[0] if "." in fqn else "")
            self.modules[fqn] = ModuleInfo(fqn, parent.depth + 1)
            parent.children.append(fqn)
        return self.modules[fqn]

    def _add_parameter(self, data: dict):
        fqn, _, short = data["name"].rpartition(".")
        self._module(fqn).parameters.setdefault(short, {"shape": list(data["shape"]), "dtype": data["dtype"]})

    def _add_collective(self, record: OpRecord, data: dict):
        if data.get("collective") not in COLLECTIVES or not isinstance(data.get("group"), list):
            raise UserError(f"not a syntorch trace: collective node {record.node} has no known 'collective' "
                            f"kind ({', '.join(COLLECTIVES)}) or no 'group' list of ranks")
        record.collective = {key: data.get(key) for key in COLLECTIVE_FIELDS}
        self.collectives.append({"node": record.node, "module": data.get("module", ""), "phase": record.phase,
                                 **record.collective})
        kind, nbytes = data["collective"], int(data.get("bytes") or 0)
        for fqn in self._ancestry(data.get("module", "")):
            self.modules[fqn].add_collective(record.section, kind, nbytes)
        count_bytes = self.phase_totals.setdefault(record.phase, {}).setdefault(kind, [0, 0])
        count_bytes[0] += 1
        count_bytes[1] += nbytes

    def _drop_containers(self):
        """ModuleDict/ModuleList never run (torch's tree leaves them out): their children move up a level."""
        for fqn in [f for f, m in self.modules.items() if m.module_type in CONTAINER_TYPES and not m.records]:
            container = self.modules.pop(fqn)
            siblings = next(m.children for m in self.modules.values() if fqn in m.children)
            at = siblings.index(fqn)
            siblings[at:at + 1] = container.children
        for module in self.walk():
            for child in module.children:
                self.modules[child].depth = module.depth + 1

    def _step_runs(self) -> dict[str, list[str]]:
        steps: dict[str, list] = {}
        for module in self.modules.values():
            for r in module.records:
                if step_index(r.phase) is not None:
                    steps.setdefault(r.phase, []).append((r.node, module.fqn, r))
        signatures = {phase: _step_signature(sorted(found, key=lambda f: f[0])) for phase, found in steps.items()}
        runs: list[list[str]] = []
        for phase in sorted(steps, key=step_index):
            run = runs[-1] if runs else [phase]
            apart = step_index(phase) - step_index(run[0])
            first, here = signatures[run[0]], signatures[phase]
            if apart == len(run) and first[0] == here[0] and grown_entries(first[1], here[1], apart) is not None:
                run.append(phase)
            else:
                runs.append([phase])
        return {run[0]: run for run in runs if len(run) > 1}

    def walk(self, fqn: str = ""):
        """Modules depth-first, parents before children, children in traced order."""
        module = self.modules[fqn]
        yield module
        for child in module.children:
            yield from self.walk(child)

    @staticmethod
    def _ancestry(fqn: str) -> list[str]:
        parts = fqn.split(".") if fqn else []
        return [""] + [".".join(parts[:i]) for i in range(1, len(parts) + 1)]

    def fold_steps(self, items: list, phase=lambda item: item.phase) -> list[tuple]:
        """fold_steps(items, self.step_runs, phase)."""
        return fold_steps(items, self.step_runs, phase)

    # --- torch's getters ------------------------------------------------------------------------
    def comm_counts(self) -> dict[str, int]:
        """Collective kind -> count over the whole run (torch keys by op; syntorch by collective kind)."""
        return dict(Counter(c["collective"] for c in self.collectives))

    def module_counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """fqn ("Global" for the root) -> section -> kind -> count, for modules with collectives (torch's
        comm_module_counts)."""
        return {m.name: {s: {k: cb[0] for k, cb in m.totals[s].items()} for s in SECTIONS}
                for m in self.modules.values() if any(m.totals.values())}


def _step_signature(found: list[tuple]) -> tuple:
    """(what must match, every input shape in order) of one decode step's (node, module, record)s."""
    what = [(fqn, r.name, r.kind, r.params, {k: v for k, v in r.collective.items() if k not in RUNNING})
            for _, fqn, r in found]
    return what, [shape for _, _, r in found for shape in r.input_shapes]


def fold_steps(items: list, runs: dict[str, list[str]], phase=lambda item: item.phase) -> list[tuple]:
    """(item, [the same item in the run's later steps]) for `items` (records, or their JSON, in traced order)
    with the items of a run's later steps left out: the k-th item of a step is the k-th of every step in its
    run (`runs`: CommReport.step_runs), as long as `items` were chosen alike in every step (one module's,
    one noise level's)."""
    later = {p for run in runs.values() for p in run[1:]}
    by_phase: dict[str, list] = {}
    for item in items:
        by_phase.setdefault(phase(item), []).append(item)
    seen: Counter = Counter()
    out = []
    for item in items:
        here = phase(item)
        if here in later:
            continue
        copies = [by_phase[p][seen[here]] for p in runs.get(here, [here])[1:]]
        seen[here] += 1
        out.append((item, copies))
    return out
