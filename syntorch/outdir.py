"""The output policy of every syntorch command: outputs appear whole, where they were asked for, and never
over anything syntorch did not write.

Folders (`atomic_output_dir`: infer and trace `--out`, export `--output` for chakra, train's
`--trace-output-dir` and checkpoints):
- A run adds its files to any folder, a user's included (the seed's scripts write beside themselves). It
  writes into a temporary folder on the target's own filesystem: beside a target that does not exist yet,
  which it then becomes in one rename; inside a target that exists (a mount point or the current folder
  cannot be renamed over), whose files are then moved up into it.
- MANIFEST (`.syntorch.json`) records what syntorch wrote there: relative paths, written last. While files
  are moved into an existing folder it lists the old and the new ones with "complete": false, so a crash
  leaves no file unrecorded and nothing that looks whole.
- A run replaces a file only if an earlier syntorch run recorded it, and only with --force (without it, a
  run whose names meet an earlier run's is refused: their files would mix). With --force, the earlier
  runs' recorded files are removed once the new run is complete, and nothing else. A name the run would
  write that holds anything unrecorded, a symbolic link, a FIFO or a device, is refused in one line,
  --force or not; so is replacing or removing the command's own inputs (`inputs`).
- Temporary names carry proof they are syntorch's: `.syntorch-tmp.<host>.<pid>.<random>.<check>`, the check
  a hash of the rest. The temporary folder is removed on any exception (Ctrl-C, and SIGTERM once the CLI
  turns it into one). One left by a killed process (SIGKILL, power loss) is removed by the next writer in
  that place once no process with its pid runs on its host; a user's file that merely looks like one (its
  check does not match) is never touched.

Files (`atomic_output_file`: export --output g.svg, convert --output x.et, ...) replace an existing regular
file of that name, as `cp` and `>` do, when the user named that very file (`named`); a file syntorch picks
the name of (train's train_log.json in --save-dir) replaces only a recorded one. A temporary file beside it
is renamed over it at the end. A folder, FIFO, device or the manifest itself is refused. A file written
into a folder with a manifest joins its record (`syntorch export --output run/graph.svg` is then replaced
with the run, not taken for a user's).
"""
import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
from pathlib import Path, PurePosixPath

from syntorch.version import __version__
from syntorch.errors import UserError

MANIFEST = ".syntorch.json"
_TMP = re.compile(r"\.syntorch-tmp\.([^.]+)\.(\d+)\.([0-9a-f]{8})\.([0-9a-f]{12})$")  # host, pid, random, check
TEMP_LOG_ENV = "SYNTORCH_TEMP_LOG"  # set in each rank by parallel.launch.spawn


def _note_temporary(tmp) -> None:
    """A killed rank runs no `finally`: under spawn, each temporary path is noted (NUL-separated) in the file
    TEMP_LOG_ENV names, and the launcher removes what is left once every rank is gone."""
    log = os.environ.get(TEMP_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(f"{os.path.abspath(tmp)}\0")


@contextlib.contextmanager
def atomic_output_dir(path: str | Path, force: bool = False, flag: str = "--out", inputs=(), expect=()):
    """Yields a temporary folder for a run's files; on success they become `path`'s (see the policy above).
    Refuses a target before the caller does any work (`expect`: names it will surely write); `flag` is the
    option the user typed, for messages; `inputs` are paths the command reads, never to replace or remove."""
    path = Path(path)
    check_output_dir(path, force, flag, inputs, expect)
    home = path if path.is_dir() else path.parent  # an existing folder may be a mount point: fill it in place
    _sweep(home)
    tmp = _make_tmp(home, path, flag)
    try:
        yield tmp
        _commit(tmp, path, force, flag, inputs)
    except OSError as e:
        if not _write_error(e, tmp, path):
            raise
        raise _cannot_write(flag, path, e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


FULL_OR_READ_ONLY = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


def _write_error(e: OSError, *places: Path) -> bool:
    """Whether `e` is the output failing (a full disk, a quota, a read-only or forbidden target), not an
    input the command was reading."""
    if e.errno in FULL_OR_READ_ONLY:
        return True
    name = os.path.abspath(e.filename) if isinstance(e.filename, str) else ""
    return e.errno in (errno.EACCES, errno.EPERM) and any(name.startswith(os.path.abspath(p)) for p in places)


def check_output_dir(path: str | Path, force: bool = False, flag: str = "--out", inputs=(),
                     new_files=()) -> list[str] | None:
    """The policy for the folder `path`: returns the files of an earlier run that --force replaces (None
    when there was none); raises UserError for a file in its place, a manifest syntorch did not write, an
    earlier run's outputs without --force, inputs among them, or a name in `new_files` (what the run
    writes, relative paths) taken by something syntorch did not write."""
    path = Path(path)
    if not os.path.lexists(path):
        return None
    if not path.is_dir():
        raise UserError(f"{flag} {path} exists and is not a folder; choose another {flag}")
    _sweep(path)
    recorded = _recorded(path)
    if recorded is None and os.path.lexists(path / MANIFEST):
        raise UserError(f"{flag} {path} holds {MANIFEST}, which syntorch did not write; choose another {flag}")
    earlier = recorded or []
    taken = _first_taken(path, new_files, set(earlier))
    if taken:
        raise UserError(f"{flag} {path} holds {taken}, which syntorch did not write; move it away or "
                        f"choose another {flag}")
    if not force and _meets(new_files, earlier):
        raise UserError(f"{flag} {path} holds the outputs of an earlier syntorch run; "
                        f"pass --force to replace them, or choose another {flag}")
    _refuse_inputs(path, [*(earlier if force else []), *new_files], inputs, flag)
    return recorded


def _meets(new_files, earlier) -> bool:
    """Whether a run's names meet an earlier run's: the same name, or one of a numbered family (rank files
    `gpt2.0.et` beside a larger run's `gpt2.7.et`, which would mix into one trace)."""
    family = {_FAMILY.sub("#", name) for name in earlier}
    return any(_FAMILY.sub("#", name) in family for name in new_files)


_FAMILY = re.compile(r"\d+")


def _refuse_inputs(path: Path, names, inputs, flag: str) -> None:
    """A run never replaces or removes what it reads (`predict run --out run --force`)."""
    read = {os.path.realpath(p) for p in inputs}
    for name in names:
        target = os.path.realpath(path / name)
        if any(target == r or target.startswith(r.rstrip(os.sep) + os.sep) for r in read):
            raise UserError(f"{flag} {path} would replace {name}, which this command reads; choose another {flag}")


def _first_taken(path: Path, new_files, recorded: set[str]) -> str | None:
    """The first name the run would write (or a folder on its way) that holds anything not recorded: a
    user's file, a link, a FIFO or a device (those even when recorded)."""
    for name in new_files:
        parts = PurePosixPath(name).parts
        for depth in range(1, len(parts) + 1):
            rel = "/".join(parts[:depth])
            target = path / rel
            if not os.path.lexists(target):
                break
            mode = os.lstat(target).st_mode
            if depth < len(parts):
                if not stat.S_ISDIR(mode):  # a file, or a link, where we need a folder
                    return rel
            elif not stat.S_ISREG(mode) or rel not in recorded:
                return rel + ("/" if stat.S_ISDIR(mode) else "")
    return None


@contextlib.contextmanager
def atomic_output_file(path: str | Path, flag: str = "--output", named: bool = True):
    """Yields a temporary file path beside `path`, renamed over `path` on success (see the policy above)."""
    path = Path(path)
    check_output_file(path, flag, named)
    _sweep(path.parent)
    with _replacing(path, flag) as tmp:
        yield tmp
    _join_record(path, create=not named)


def check_output_file(path: Path, flag: str = "--output", named: bool = True) -> None:
    """The policy for the single file `path` (see above); raises UserError where it may not be written."""
    path = Path(path)
    if path.name == MANIFEST:
        raise UserError(f"{flag} {path}: {MANIFEST} is syntorch's record of a folder; give another file name")
    if not os.path.lexists(path):
        return
    mode = os.stat(path).st_mode if path.exists() else os.lstat(path).st_mode
    if stat.S_ISDIR(mode):
        raise UserError(f"{flag} {path} is a folder; give a file name")
    if not stat.S_ISREG(mode):
        raise UserError(f"{flag} {path} is not a regular file (a FIFO, socket or device); give another file name")
    record = _recorded(path.parent)
    if not named and path.name not in (record or []):
        raise UserError(f"{flag} {path.parent} holds {path.name}, which syntorch did not write; "
                        f"move it away or choose another {flag}")


@contextlib.contextmanager
def _replacing(path: Path, flag: str):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / _tmp_name()
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666 & ~_umask()))
        _note_temporary(tmp)
    except OSError as e:
        raise _cannot_write(flag, path, e) from None
    try:
        yield tmp
        os.replace(tmp, os.path.realpath(path))  # through a link to a regular file: the file, as cp does
    except OSError as e:
        if not _write_error(e, tmp, path):
            raise
        raise _cannot_write(flag, path, e) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _commit(tmp: Path, path: Path, force: bool, flag: str, inputs) -> None:
    files = _files(tmp)
    try:
        if not os.path.lexists(path):  # the whole folder in one rename (8192 rank traces were 8192 renames)
            _write_manifest(tmp, files)
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp-like 0700; outputs get the usual permissions
            os.replace(tmp, path)
            return
    except OSError as e:
        raise _cannot_write(flag, path, e) from None
    # again, now that the run's names are known: the folder may also have changed during a long run
    earlier = check_output_dir(path, force, flag, inputs, files) or []
    _write_manifest(path, sorted({*earlier, *files}), complete=False)  # a crash below leaves no file unrecorded
    if force:
        _remove_files(path, earlier)
    _move_into(tmp, path)
    _write_manifest(path, sorted({*files, *([] if force else earlier)}))


def _recorded(path: Path) -> list[str] | None:
    """The files `path`'s manifest lists; None without one we wrote."""
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


def _files(folder: Path) -> list[str]:
    found = []
    for root, _, names in os.walk(folder):
        rel = Path(root).relative_to(folder).as_posix()  # a Path per folder, not per file (16,384 rank files)
        found += names if rel == "." else (f"{rel}/{name}" for name in names)
    return sorted(found)


def _write_manifest(folder: Path, files: list[str], complete: bool = True) -> None:
    with _replacing(folder / MANIFEST, "--out") as tmp:
        tmp.write_text(json.dumps({"syntorch_version": __version__, "complete": complete, "files": files},
                                  indent=1) + "\n")


def _join_record(path: Path, create: bool) -> None:
    """Records `path` in its folder's manifest; `create`: also where there is none yet (a name syntorch
    picked, which a later run may then replace)."""
    record = _manifest(path.parent)
    if record is None and create and not os.path.lexists(path.parent / MANIFEST):
        record = {"files": [], "complete": True}
    if record is not None and path.name not in record["files"]:
        _write_manifest(path.parent, sorted([*record["files"], path.name]), record.get("complete") is True)


def _remove_files(folder: Path, files: list[str]) -> None:
    """An earlier run's regular files, and the folders they leave empty; nothing else (no link is followed)."""
    for name in files:
        target = folder / name
        if any(p.is_symlink() for p in (target, *target.parents) if p != folder and folder in p.parents):
            continue
        if os.path.lexists(target) and stat.S_ISREG(os.lstat(target).st_mode):
            target.unlink()
        for parent in target.parents:
            if parent == folder:
                break
            try:
                parent.rmdir()
            except OSError:  # not empty: something else is still in it
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
        tmp = home / _tmp_name()
        tmp.mkdir(mode=0o700)
        _note_temporary(tmp)
        return tmp
    except OSError as e:
        raise _cannot_write(flag, path, e) from None


def _cannot_write(flag: str, path: Path, error: OSError) -> UserError:
    # mkdir under a file says "File exists" or "Not a directory": name the file in the way instead
    blocker = next((p for p in path.parents if os.path.lexists(p) and not p.is_dir()), None)
    why = f"{blocker} is a file, not a folder" if blocker else error.strerror or str(error)
    return UserError(f"cannot write {flag} {path}: {why}")


def _tmp_name() -> str:
    # the host and pid tell a later run whether the writer is gone (see _sweep); the check proves the name
    # is ours, so a user's file that happens to start the same way is never swept
    stem = f"{_host()}.{os.getpid()}.{secrets.token_hex(4)}"
    return f".syntorch-tmp.{stem}.{_check(stem)}"


def _check(stem: str) -> str:
    return hashlib.sha256(f"syntorch temporary {stem}".encode()).hexdigest()[:12]


def is_temporary(name: str) -> bool:
    """Whether `name` is a temporary output syntorch made (its check matches)."""
    match = _TMP.match(name)
    return bool(match) and match[4] == _check(f"{match[1]}.{match[2]}.{match[3]}")


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
        if is_temporary(name) and match[1] == _host() and not _alive(int(match[2])):
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
