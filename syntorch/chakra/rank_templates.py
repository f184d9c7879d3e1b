"""Rank files that are a checked rank's but for some communication nodes, found from their bytes.

Our writer writes every rank of a stage (and rank kind) from one template, overwriting in place only each
communication node's group id and peers (chakra/writer.py's StageTemplate: ids of one width, peers padded),
so those files have the template's length and differ from it only inside communication nodes. For such a
file, what `syntorch validate` finds of its nodes' ids, dependencies and cycles is the template's, and so is
what it finds of every node but those that differ; only these are decoded and checked again, with every
rule that reads the rank (validator.py). That holds for any file that passes `match`, whoever wrote it: a
differing node must be a communication node of the template, lie at the same bytes, and keep its id and
dependencies. Anything else is decoded and checked whole, and becomes a template itself.
"""
from dataclasses import dataclass

import numpy as np
from chakra.schema.protobuf import et_def_pb2 as et

from syntorch.chakra.reader import parse_nodes
from syntorch.chakra.writer import varint

COMM_NODES = (et.COMM_COLL_NODE, et.COMM_SEND_NODE, et.COMM_RECV_NODE)
SAMPLE = 1024  # every SAMPLE-th byte is compared first: a file of another stage fails on a few thousand bytes


@dataclass
class Template:
    body: np.ndarray  # the node messages' bytes (uint8), length prefixes included
    starts: np.ndarray  # where each node message's own bytes start in `body`, and end
    ends: np.ndarray
    comm: dict  # message index -> its node, for the communication nodes
    comms: dict  # message index -> what the checks across ranks read of it (validate.Comm)
    count: int  # nodes
    problems: object  # what validator.py found of its nodes (validator.NodeProblems)


class RankTemplates:
    """The checked files' bodies by length; `match` finds the template of a file's body, if any."""

    def __init__(self):
        self.by_length: dict[int, list[Template]] = {}

    def add(self, messages: list[bytes], nodes: list[et.Node], problems, comm_of) -> list:
        """Keeps a checked file's body, its communication nodes (as they are and as `comm_of` reads them) and
        `problems`; returns what `comm_of` read, in file order."""
        lengths = np.array([len(m) for m in messages], dtype=np.int64)
        prefixes = np.array([len(varint(n)) for n in lengths.tolist()], dtype=np.int64)
        ends = np.cumsum(prefixes + lengths)
        body = np.frombuffer(b"".join(varint(len(m)) + m for m in messages), dtype=np.uint8)
        comm = {i: node for i, node in enumerate(nodes) if node.type in COMM_NODES}
        comms = {i: comm_of(node) for i, node in comm.items()}
        self.by_length.setdefault(len(body), []).append(Template(body, ends - lengths, ends, comm, comms, len(nodes),
                                                                 problems))
        return list(comms.values())

    def match(self, data: bytes, start: int, path) -> tuple[Template, dict[int, tuple[et.Node, bytes]]] | None:
        """The template the node messages of `data` (from `start`) are a copy of but for some communication
        nodes, and those nodes decoded with their bytes (by message index); None when there is none."""
        body = np.frombuffer(data, dtype=np.uint8, offset=start)
        for template in self.by_length.get(len(body), ()):
            if not _only_comm(template, np.flatnonzero(body[::SAMPLE] != template.body[::SAMPLE]) * SAMPLE):
                continue
            differ = _differ(body, template.body)
            found = _decoded(template, data, start, differ, path) if _only_comm(template, differ) else None
            if found is not None:
                return found
        return None


def _differ(body: np.ndarray, other: np.ndarray) -> np.ndarray:
    """The offsets where two bodies of one length differ, compared eight bytes at a time."""
    whole = len(body) // 8 * 8
    words = np.flatnonzero(body[:whole].view(np.uint64) != other[:whole].view(np.uint64))
    at = np.concatenate([(words[:, None] * 8 + np.arange(8)).ravel(), np.arange(whole, len(body))])
    return at[body[at] != other[at]]


def _only_comm(template: Template, at: np.ndarray) -> bool:
    """Whether the byte offsets `at` all lie inside communication nodes' own bytes (not their lengths)."""
    index = np.searchsorted(template.ends, at, side="right")
    return bool((at >= template.starts[index]).all()) and all(i in template.comm for i in set(index.tolist()))


def _decoded(template: Template, data: bytes, start: int, differ: np.ndarray, path):
    """The differing nodes decoded, if each keeps its template node's id and dependencies."""
    index = sorted(set(np.searchsorted(template.ends, differ, side="right").tolist()))
    messages = [data[start + template.starts[i]:start + template.ends[i]] for i in index]
    nodes = parse_nodes(messages, path)
    for i, node in zip(index, nodes):
        if _links(node) != _links(template.comm[i]):
            return None
    return template, {i: pair for i, pair in zip(index, zip(nodes, messages))}


def _links(node: et.Node) -> tuple:
    """What the checks of ids, dependencies and cycles read of a node."""
    return node.id, list(node.data_deps), list(node.ctrl_deps)
