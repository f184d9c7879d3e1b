"""Files users hand us (configs, traces, checkpoints' JSON): read them whole, or say in one line what is wrong."""
import json
from pathlib import Path

from syntorch.errors import UserError


def read_json(path, what: str = "file"):
    """The JSON value in `path`; a UserError naming the file when it is missing, unreadable or not JSON."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} not found")
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{what} {path} is not valid JSON: {e}") from None


def read_lines(path, what: str = "file") -> list[str]:
    """The non-blank lines of the text file `path` (line ends stripped); a UserError naming the file when it
    is missing, unreadable, not UTF-8 text or holds no line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} not found")
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
