"""Reading .et files: one length-delimited GlobalMetadata (optional), then Nodes. Decodes ours and mlc-chakra's
converter output alike; a file that is not a Chakra trace is a UserError naming it."""
import re
from collections import defaultdict
from pathlib import Path

from chakra.schema.protobuf import et_def_pb2 as et
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from syntorch.errors import UserError


TRACE_NAME = re.compile(r"(.+)\.(\d+)\.et$")  # <prefix>.<rank>.et: ASTRA-sim opens f"{prefix}.{npu}.et"


def find_traces(path) -> list[tuple[int, Path]]:
    """DIR (one prefix of `<prefix>.<rank>.et` files in it) or PREFIX -> [(rank, file)] sorted by rank."""
    path = Path(path)
    folder, prefix = (path, None) if path.is_dir() else (path.parent, path.name)
    found = defaultdict(list)
    for f in folder.glob("*.et") if folder.is_dir() else []:
        m = TRACE_NAME.match(f.name)
        if m and (prefix is None or m.group(1) == prefix):
            found[m.group(1)].append((int(m.group(2)), f))
    if not found:
        raise UserError(f"no <prefix>.<rank>.et files at {path}; give the trace folder or its prefix")
    if len(found) > 1:
        raise UserError(f"{path} holds traces of several prefixes ({', '.join(sorted(found))}); give one prefix")
    files = sorted(next(iter(found.values())))
    for _, f in files:  # a FIFO or device would block the read or never end
        if not f.is_file():
            raise UserError(f"{f} is not a regular file (a folder, FIFO or device); give a folder of .et files")
    return files


def check_trace_name(path, rank: int, flag: str = "--output") -> None:
    """A rank's trace must be named `<prefix>.<rank>.et`, the rank written as ASTRA-sim writes it (`7`, not
    `007`): the name `syntorch validate` (find_traces) and the simulator look for."""
    path = Path(path)
    m = TRACE_NAME.match(path.name)
    prefix = m.group(1) if m else re.sub(r"\.\d+$", "", path.stem) or "trace"  # trace.et, x.0.json -> trace, x
    wanted = path.with_name(f"{prefix}.{rank}.et")
    if not m:
        raise UserError(f"{flag} {path} is not named <prefix>.<rank>.et, which syntorch validate and ASTRA-sim look "
                        f"for; for rank {rank} give e.g. {wanted}")
    if m.group(2) != str(rank):
        raise UserError(f"{flag} {path} is named for rank {m.group(2)} but --rank is {rank}; give {wanted}")


def read_trace(path: Path) -> tuple[et.GlobalMetadata | None, list[et.Node]]:
    """Decodes one length-delimited .et file (header None when it starts with a node instead);
    UserError when it is not a Chakra trace at all."""
    header, body = split_messages(read_bytes(path), path)
    return header, parse_nodes(body, path)


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None


def split_messages(data: bytes, path) -> tuple[et.GlobalMetadata | None, list[bytes]]:
    """The GlobalMetadata header (None if the file starts with a node) and the node messages."""
    messages, pos = [], 0
    while pos < len(data):
        size, pos = _varint(data, pos, path)
        if pos + size > len(data):
            raise UserError(f"{path}: corrupt .et (a message runs past the end of the file)")
        messages.append(data[pos:pos + size])
        pos += size
    if not messages:
        raise UserError(f"{path}: empty .et file (no GlobalMetadata, no nodes)")
    header = _header(messages[0], path)
    return header, messages if header is None else messages[1:]


def split_header(data: bytes, path) -> tuple[et.GlobalMetadata | None, int]:
    """split_messages' header, and where the node messages start in `data`."""
    if not data:
        raise UserError(f"{path}: empty .et file (no GlobalMetadata, no nodes)")
    size, pos = _varint(data, 0, path)
    if pos + size > len(data):
        raise UserError(f"{path}: corrupt .et (a message runs past the end of the file)")
    header = _header(data[pos:pos + size], path)
    return header, 0 if header is None else pos + size


def _header(message: bytes, path) -> et.GlobalMetadata | None:
    """The first message as GlobalMetadata, or None when it is a node."""
    header = _parse(et.GlobalMetadata, message)
    first = _parse(et.Node, message)
    if header is None or (UnknownFieldSet(header) and first is not None and first.type):
        if first is None:
            raise UserError(f"{path}: corrupt .et (the first message is neither GlobalMetadata nor a node)")
        return None
    return header


def parse_nodes(messages: list[bytes], path) -> list[et.Node]:
    nodes = [_parse(et.Node, m) for m in messages]
    if any(n is None or UnknownFieldSet(n) for n in nodes):
        raise UserError(f"{path}: corrupt .et (a message does not decode as a Chakra node)")
    return nodes


def _parse(message_type, data: bytes):
    try:
        return message_type.FromString(data)
    except DecodeError:
        return None


def _varint(data: bytes, pos: int, path) -> tuple[int, int]:
    result = shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        result |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return result, pos
        shift += 7
    raise UserError(f"{path}: corrupt .et (a length prefix is cut off)")
