"""The output policy of every syntorch command: outputs appear whole, where they were asked for, and never
over anything syntorch did not write.

Folders (`atomic_output_dir`: infer and trace `--out`, export `--output` for chakra, train's
`--trace-output-dir` and checkpoints):
- The run writes into a temporary folder `.syntorch-tmp.<host>.<pid>.<random>` on the target's own
  filesystem: beside a target that does not exist yet, which it then becomes in one rename; inside a target
  that exists (an empty folder, a mount point or the current folder cannot be renamed over), whose files
  are then moved up into it.
- MANIFEST (`.syntorch.json`) records what the run wrote: the folder's files as relative paths, written
  last. While files are moved into an existing folder it lists the old and the new ones with
  "complete": false, so a crash leaves no file unrecorded and nothing that looks whole.
- A target holding anything its manifest does not list (a user's notes, a home folder) is refused in one
  line, with or without --force. One holding an earlier run's outputs is refused without --force; with it,
  the files its manifest lists, and nothing else, are removed once the new run is complete.
- The temporary folder is removed on any exception (Ctrl-C, and SIGTERM once the CLI turns it into one).
  One left by a killed process (SIGKILL, power loss) is removed by the next writer in that place once no
  process with its pid runs on its host (host names are taken to identify a pid namespace).

Files (`atomic_output_file`: export --output g.svg, convert --output x.et, ...) replace an existing file of
that name, as `cp` and `>` do: the user named that very file. A temporary file beside it is renamed over it
at the end. A path that is a folder is refused. A file written into a folder with a manifest joins its
record (`syntorch export --output run/graph.svg` is then replaced with the run, not taken for a user's).
"""
import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path, PurePosixPath

from syntorch.version import __version__
from syntorch.errors import UserError

MANIFEST = ".syntorch.json"
_TMP = re.compile(r"\.syntorch-tmp\.([^.]+)\.(\d+)\.")  # host, pid
TEMP_LOG_ENV = "SYNTORCH_TEMP_LOG"  # set in each rank by parallel.launch.spawn


def _note_temporary(tmp) -> None:
    """A killed rank runs no `finally`: under spawn, each temporary path is noted (NUL-separated) in the file
    TEMP_LOG_ENV names, and the launcher removes what is left once every rank is gone."""
    log = os.environ.get(TEMP_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(f"{os.path.abspath(tmp)}\0")


@contextlib.contextmanager
def atomic_output_dir(path: str | Path, force: bool = False, flag: str = "--out"):
    """Yields a temporary folder for a run's files; on success they become `path`'s (see the policy above).
    Refuses a target before the caller does any work; `flag` is the option the user typed, for messages."""
    path = Path(path)
    check_output_dir(path, force, flag)
    home = path if path.is_dir() else path.parent  # an existing folder may be a mount point: fill it in place
    _sweep(home)
    tmp = _make_tmp(home, path, flag)
    try:
        yield tmp
        _commit(tmp, path, force, flag)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_output_dir(path: str | Path, force: bool = False, flag: str = "--out") -> list[str] | None:
    """The policy for the folder `path`: returns the files of an earlier run that --force replaces (None
    when there was none); raises UserError for a file, a folder holding anything syntorch did not write, or
    an earlier run's outputs without --force."""
    path = Path(path)
    if not os.path.lexists(path):
        return None
    if not path.is_dir():
        raise UserError(f"{flag} {path} exists and is not a folder; choose another {flag}")
    _sweep(path)
    earlier = _recorded(path)
    stray = _stray(path, earlier)
    if stray:
        raise UserError(f"{flag} {path} holds {stray}, which syntorch did not write; choose a new or empty folder")
    if earlier is not None and not force:
        raise UserError(f"{flag} {path} holds the outputs of an earlier syntorch run; "
                        f"pass --force to replace them, or choose another {flag}")
    return earlier


@contextlib.contextmanager
def atomic_output_file(path: str | Path, flag: str = "--output"):
    """Yields a temporary file path beside `path`, renamed over `path` on success (see the policy above)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; give a file name")
    _sweep(path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(), dir=path.parent)
        os.close(fd)
        _note_temporary(tmp)
    except OSError as e:
        raise _cannot_write(flag, path, e) from None
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
        os.replace(tmp, path)
        _join_record(path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _commit(tmp: Path, path: Path, force: bool, flag: str) -> None:
    files = _files(tmp)
    if not os.path.lexists(path):  # the whole folder in one rename (8192 rank traces were 8192 renames)
        _write_manifest(tmp, files)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; outputs get the usual permissions
        os.replace(tmp, path)
        return
    earlier = check_output_dir(path, force, flag) or []  # again: the folder may have changed during a long run
    _write_manifest(path, sorted({*earlier, *files}), complete=False)  # a crash below leaves no file unrecorded
    _remove_files(path, earlier)
    _move_into(tmp, path)
    _write_manifest(path, files)


def _recorded(path: Path) -> list[str] | None:
    """The files `path`'s manifest lists; None without one we wrote (then the file is a stray one)."""
    record = _manifest(path)
    return None if record is None else record["files"]


def _manifest(path: Path) -> dict | None:
    try:
        record = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) and _stays_inside(f) for f in files):
        return None
    return record


def _stays_inside(name: str) -> bool:
    # a manifest is read from disk: --force must never reach outside the folder through it
    pure = PurePosixPath(name)
    return bool(pure.parts) and not pure.is_absolute() and ".." not in pure.parts


def _stray(path: Path, earlier: list[str] | None) -> str | None:
    """The first entry under `path` that is neither a recorded file, a folder of recorded files nor another
    writer's temporary output; None when there is none. Symbolic links are never ours."""
    recorded = set() if earlier is None else {PurePosixPath(f).as_posix() for f in earlier} | {MANIFEST}
    folders = {p.as_posix() for f in recorded for p in PurePosixPath(f).parents}
    for root, dirs, names in os.walk(path):
        rel = Path(root).relative_to(path)
        dirs[:] = [d for d in dirs if not _TMP.match(d)]  # live writers' (stale ones were swept)
        for name in names:
            if (rel / name).as_posix() not in recorded and not _TMP.match(name):
                return (rel / name).as_posix()
        for name in dirs:
            if (rel / name).as_posix() not in folders or os.path.islink(os.path.join(root, name)):
                return (rel / name).as_posix() + "/"
    return None


def _files(folder: Path) -> list[str]:
    return sorted((Path(root, name).relative_to(folder)).as_posix()
                  for root, _, names in os.walk(folder) for name in names)


def _write_manifest(folder: Path, files: list[str], complete: bool = True) -> None:
    with atomic_output_file(folder / MANIFEST) as tmp:
        tmp.write_text(json.dumps({"syntorch_version": __version__, "complete": complete, "files": files},
                                  indent=1) + "\n")


def _join_record(path: Path) -> None:
    record = _manifest(path.parent)
    if path.name != MANIFEST and record is not None and path.name not in record["files"]:
        _write_manifest(path.parent, sorted([*record["files"], path.name]), record.get("complete") is True)


def _remove_files(folder: Path, files: list[str]) -> None:
    """An earlier run's files, and the folders they leave empty; nothing else."""
    for name in files:
        target = folder / name
        target.unlink(missing_ok=True)
        for parent in target.parents:
            if parent == folder:
                break
            try:
                parent.rmdir()
            except OSError:  # not empty: something else of ours is still in it
                break


def _move_into(src: Path, dst: Path) -> None:
    for item in src.iterdir():
        target = dst / item.name
        if item.is_dir() and target.is_dir() and not target.is_symlink():
            _move_into(item, target)
        else:
            os.replace(item, target)


def _make_tmp(home: Path, path: Path, flag: str) -> Path:
    try:
        home.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(), dir=home))
        _note_temporary(tmp)
        return tmp
    except OSError as e:
        raise _cannot_write(flag, path, e) from None


def _cannot_write(flag: str, path: Path, error: OSError) -> UserError:
    # mkdir under a file says "File exists" or "Not a directory": name the file in the way instead
    blocker = next((p for p in path.parents if os.path.lexists(p) and not p.is_dir()), None)
    why = f"{blocker} is a file, not a folder" if blocker else error.strerror
    return UserError(f"cannot write {flag} {path}: {why}")


def _tmp_prefix() -> str:
    # the host and pid tell a later run whether the writer is gone (see _sweep); mkstemp adds [a-z0-9_]
    return f".syntorch-tmp.{_host()}.{os.getpid()}."


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "-"


def _sweep(folder: Path) -> None:
    """Removes the temporary outputs that killed syntorch processes of this host left in `folder`."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        match = _TMP.match(name)
        if match and match[1] == _host() and not _alive(int(match[2])):
            stale = folder / name
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except PermissionError:  # it does, as another user's
        return True
    except (ProcessLookupError, OverflowError):
        return False
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
