"""Long symbolic generations: trace the first decode steps, derive the others.

On `meta` every decode step runs (no values: no stop token fires, no row of a ragged batch finishes, beam
search reorders the cache every step), and step i + 1 differs from step i only by the one key it adds: the
same ops, modules, collectives and data flow, while sizes that span the keys (attention FLOPs and bytes, a
padded batch's mask), KV-cache versions, collective `order`s and p2p tags, node ids and the phase name move
on by the same amount every step. So a run is traced up to decode[base + 2] and stopped there; steps `base`
and `base + 1` give the rule (each attribute constant or moving by a fixed integer step, each input the same
node, a node of the same step or of the step before), which must rebuild the traced decode[base + 2] exactly,
and the rest is derived from it, node for node as a full trace makes it (tests/test_derived_decode.py).

What is traced, never derived: the prefill; decode[0] and decode[1] (decode[0] reads the prefill's choice and
first sees tensors the later steps share, so it is larger and decode[1] reads it at other offsets); the
steps before a sliding window starts cutting, and the first cutting one (`first_rule_step`); a run on a real
device (its values decide stop tokens, finished rows and beams); and, in full, any run whose rule does not
rebuild decode[base + 2].
"""
from dataclasses import dataclass

from syntorch.generate import GenerationResult
from syntorch.trace.graph import TraceGraph, no_gc


class StepsTraced(Exception):
    """Raised on entering the first decode step to derive: the run stops there."""


@dataclass(frozen=True)
class SymbolicGeneration:
    """What a generation on meta does, known before it runs: `new_tokens` tokens after a [rows, prompt_len]
    prompt whose row b has pads[b] pad slots; the prefill chooses the first token, decode steps the others."""
    prompt_len: int
    pads: tuple[int, ...]
    new_tokens: int

    @property
    def decode_steps(self) -> int:
        return self.new_tokens - 1

    def result(self) -> GenerationResult:
        """generate's result on meta: placeholder zeros for every id, unpadded; meta's step times are
        the tracer's, not a speed, and none is kept."""
        return GenerationResult([[0] * (self.prompt_len - p + self.new_tokens) for p in self.pads],
                                [self.prompt_len - p for p in self.pads], 0.0, [0.0] * self.decode_steps)

    def first_rule_step(self, config) -> int:
        """The first decode step of the rule: 2, or the step after a sliding window starts cutting (decode[i]
        attends to prompt_len + i + 1 keys, so a window w cuts from i = w - prompt_len on)."""
        windows = {config.layer_window(layer) for layer in range(config.n_layer)} - {0}
        return max([2] + [w - self.prompt_len + 1 for w in windows])

    def stop_step(self, config) -> int | None:
        """The decode step the trace stops at (the rule's two steps and its check traced before it); None
        when every step is traced: learning and checking the rule costs about what tracing a few steps
        does, so a run derives only when it has at least as many steps left as it traced."""
        stop = self.first_rule_step(config) + 3
        return stop if self.decode_steps >= 2 * stop else None


class StepScope:
    """generate's phase_scope over the tracer's: notes where each decode step's nodes begin and stops the run
    (StepsTraced) on entering decode[stop]."""

    def __init__(self, tracer, stop: int):
        self.tracer, self.stop = tracer, stop
        self.starts: list[int] = []  # decode[i]'s first node id in the tracer's graph

    def __call__(self, name: str):
        if name.startswith("decode["):
            if len(self.starts) == self.stop:
                raise StepsTraced
            self.starts.append(len(self.tracer.graph))
        return self.tracer.phase(name)


def replicated_ids(ids: list[int], calls, n_layers: int) -> list[int]:
    """Node ids of a first-layer-only trace as replicate.py renumbers them: each earlier layer call's nodes
    come n_layers times."""
    return [i + (n_layers - 1) * sum(c.end - c.start for c in calls if c.end <= i) for i in ids]


@dataclass
class _Node:
    """How one node of a decode step moves from step to step (m: steps after the rule's first step)."""
    attrs: dict  # a copy of the rule's first step's, rewritten for each derived step
    moving: list[tuple[str, object, object]]  # (key, value, step): an int or a list of ints moving linearly
    phase: bool  # its phase is the step's
    named: bool  # its name is its id ("t123")
    inputs: list[tuple[int, int, dict]]  # (back, x, edge): x in the step `back` steps before, or node x (back -1)


def learn_rule(graph: TraceGraph, starts: list[int]) -> "DecodeRule | None":
    """The rule of a graph traced through decode[base + 2] (`starts`: each traced step's first node id,
    then the graph's end), if it rebuilds decode[base + 2]."""
    rule = DecodeRule(graph, starts, len(starts) - 4)
    return rule if rule.rebuilds(rule.base + 2) else None


class DecodeRule:
    """The rule learned from decode[base] and decode[base + 1] and the steps it derives."""

    def __init__(self, graph: TraceGraph, starts: list[int], base: int):
        self.graph, self.base = graph, base
        self.starts = starts[:base + 1]  # decode[0] .. decode[base] as traced
        self.size = starts[base + 1] - starts[base]
        self.nodes = None
        if starts[base + 2] - starts[base + 1] == starts[base + 3] - starts[base + 2] == self.size:
            self.nodes = _learn(graph, starts, base)

    def start(self, step: int) -> int:
        return self.starts[step] if step < len(self.starts) else self.starts[-1] + (step - self.base) * self.size

    def rebuilds(self, step: int) -> bool:
        """Whether the rule gives traced decode[step] exactly: every attribute and every input edge."""
        if self.nodes is None:
            return False
        first = self.start(step)
        nodes, edges = self.step(step)
        preds = [{} for _ in nodes]
        for u, v, edge in edges:
            preds[v - first][u] = edge
        return all(nodes[k] == self.graph.node_attrs[first + k] and preds[k] == self.graph.preds[first + k]
                   for k in range(self.size))

    def step(self, step: int) -> tuple[list[dict], list[tuple[int, int, dict]]]:
        """decode[step]'s node attributes and input edges, numbered from its first node on. The attribute
        dicts are the rule's own, rewritten by the next call: TraceGraph.append copies them (one copy per
        derived node, not two)."""
        m, first, phase = step - self.base, self.start(step), f"decode[{step}]"
        where = (first, self.start(step - 1))
        nodes, edges = [], []
        for k, node in enumerate(self.nodes):
            d = node.attrs
            for key, value, delta in node.moving:
                d[key] = value + m * delta if isinstance(value, int) else [a + m * b for a, b in zip(value, delta)]
            if node.phase:
                d["phase"] = phase
            if node.named:
                d["name"] = f"t{first + k}"
            nodes.append(d)
            edges.extend((x if back < 0 else where[back] + x, first + k, edge) for back, x, edge in node.inputs)
        return nodes, edges


def derive_steps(graph: TraceGraph, rule: DecodeRule, steps: int) -> TraceGraph:
    """`graph` (traced through decode[rule.base + 2]) with decode[rule.base + 3 ..] up to `steps` decode
    steps appended, as a full trace would have made them."""
    with no_gc():
        for step in range(rule.base + 3, steps):
            graph.append(*rule.step(step))
    graph.__dict__.pop("_orders", None)  # collective orders moved on: TraceGraph rebuilds its counters
    return graph


def _learn(graph: TraceGraph, starts: list[int], base: int) -> list[_Node] | None:
    """Each node of decode[base] with how it moves to decode[base + 1]; None if one moves otherwise."""
    a, b = starts[base], starts[base + 1]
    nodes = []
    for k in range(b - a):
        node = _node(graph.node_attrs[a + k], graph.node_attrs[b + k], (a + k, b + k), base)
        inputs = node and _inputs(graph.preds[a + k], graph.preds[b + k], starts, base)
        if inputs is None:
            return None
        node.inputs = inputs
        nodes.append(node)
    return nodes


def _node(one: dict, two: dict, ids: tuple[int, int], base: int) -> _Node | None:
    if one.keys() != two.keys():
        return None
    node = _Node(dict(one), [], False, False, [])
    for key, x in one.items():
        y = two[key]
        if type(x) is type(y) and x == y:
            continue
        if key == "phase" and (x, y) == (f"decode[{base}]", f"decode[{base + 1}]"):
            node.phase = True
        elif key == "name" and (x, y) == tuple(f"t{i}" for i in ids):
            node.named = True
        elif _ints(x) and _ints(y):
            node.moving.append((key, x, y - x))
        elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y) and all(map(_ints, x + y)):
            node.moving.append((key, x, [q - p for p, q in zip(x, y)]))
        else:
            return None
    return node


def _ints(x) -> bool:
    return type(x) is int  # not bool, not float: a moving float would not derive exactly


def _inputs(one: dict, two: dict, starts: list[int], base: int) -> list[tuple[int, int, dict]] | None:
    """The inputs of a node of decode[base] as (back, x, edge), if the same node's in decode[base + 1]
    are the same ones moved on by a step."""
    if len(one) != len(two):
        return None
    inputs = []
    for (u, edge), (w, edge2) in zip(one.items(), two.items()):
        here = _placed(u, starts, base)
        if edge != edge2 or here != _placed(w, starts, base + 1):
            return None
        inputs.append((*here, edge))
    return inputs


def _placed(u: int, starts: list[int], step: int) -> tuple[int, int]:
    """(0, offset) in decode[step], (1, offset) in the step before, else (-1, u): a node every step shares."""
    for back in (0, 1):
        if u >= starts[step - back]:
            return back, u - starts[step - back]
    return -1, u
