"""Files users hand us (configs, traces, checkpoints' JSON): read them whole, or say in one line what is wrong."""
import json
import os
from pathlib import Path

from syntorch.errors import UserError


def read_json(path, what: str = "file"):
    """The JSON value in `path`; a UserError naming the file when it is missing, unreadable or not JSON."""
    path = Path(path)
    _check_regular(path, what)
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{what} {path} is not valid JSON: {e}") from None


def _check_regular(path: Path, what: str) -> None:
    """A regular file: a missing one is "not found"; a device, FIFO or folder is named as such (reading
    /dev/zero never ends, a FIFO may block)."""
    if not os.path.exists(path):
        raise UserError(f"{what} {path} not found")
    if not path.is_file():
        raise UserError(f"{what} {path} is not a regular file (a folder, device or FIFO); give a text file")


def read_lines(path, what: str = "file") -> list[str]:
    """The non-blank lines of the text file `path` (line ends stripped); a UserError naming the file when it
    is missing, unreadable, not UTF-8 text or holds no line."""
    path = Path(path)
    _check_regular(path, what)
    try:
        lines = [line.rstrip("\r\n") for line in path.read_text(encoding="utf-8").splitlines()]
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"{what} {path} is not UTF-8 text") from None
    lines = [line for line in lines if line.strip()]
    if not lines:
        raise UserError(f"{what} {path} is empty; give one prompt per line")
    return lines
