"""Output folders that appear whole or not at all: written under a temporary name, renamed at the end."""
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from syntorch.errors import UserError

TEMP_LOG_ENV = "SYNTORCH_TEMP_LOG"  # set in each rank by parallel.launch.spawn


def _note_temporary(tmp) -> None:
    """A killed rank runs no `finally`: under spawn, each temporary path is noted (NUL-separated) in the file
    TEMP_LOG_ENV names, and the launcher removes what is left once every rank is gone."""
    log = os.environ.get(TEMP_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(f"{os.path.abspath(tmp)}\0")


@contextlib.contextmanager
def atomic_output_dir(path: str | Path, force: bool = False, allow_existing: bool = True):
    """Yields a temporary folder beside `path`; on success its files replace `path`'s same-named files.

    An existing `path` is kept (other runs' files stay) unless `allow_existing` is False, in which case it
    must be empty or `force` given. On any exception nothing is left behind.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"output {path} exists and is not a folder; choose another --out")
    if path.exists() and any(path.iterdir()) and not allow_existing and not force:
        raise UserError(f"output folder {path} already holds files; remove it or pass --force")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        _note_temporary(tmp)
    except OSError as e:
        raise UserError(f"cannot write output folder {path}: {e.strerror}") from None
    try:
        yield tmp
        if force and path.exists():
            shutil.rmtree(path)
        if not path.exists():  # the whole folder in one rename (8192 rank traces were 8192 renames)
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; outputs get the usual permissions
            os.replace(tmp, path)
            return
        for item in tmp.iterdir():
            target = path / item.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(item, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output_file(path: str | Path):
    """Yields a temporary file path beside `path`, renamed to `path` on success."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"output {path} is a folder; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        _note_temporary(tmp)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
