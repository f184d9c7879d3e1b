"""The output policy (syntorch/outdir.py) as every command that writes a folder applies it: infer (one rank
and symbolic TP), trace, export --format chakra and train's --trace-output-dir; and export's file outputs.

Tiny models and sizes throughout; train (profiler + converter, ~10 s a run) runs once, into a mount point."""
import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from syntorch import outdir
from syntorch.cli import main
from syntorch.config import save_model_config
from syntorch.errors import UserError
from syntorch.export import networkx_json
from syntorch.models import build_model
from syntorch.outdir import MANIFEST, atomic_output_dir
from syntorch.trace import Tracer
from tests.train.test_train import make_model, make_squad, make_tokenizer


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """What the commands read: a tiny model config, a saved graph, SQuAD, a tokenizer and a tiny GPT-2."""
    root = tmp_path_factory.mktemp("inputs")
    save_model_config(tiny_config("gpt2", n_layer=2, vocab_size=200), root / "tiny.json")
    model = build_model(tiny_config("gpt2"))
    with Tracer(model, meta={"model": "tiny-gpt2"}) as tracer:
        model(torch.randint(0, 128, (1, 6)))
    networkx_json.export(tracer.graph, root / "graph.json")
    make_squad(root / "squad.json", articles=2)
    make_tokenizer(root / "tok")
    make_model(root / "gpt2", "gpt2")
    return root


@dataclass(frozen=True)
class Command:
    name: str
    flag: str  # the option naming the output folder, as messages must say it
    writes: str  # a file every run leaves in the folder
    args: tuple  # before the flag and the folder

    def argv(self, ws: Path, out, *extra) -> list[str]:
        return [*(str(ws / a[3:]) if a.startswith("ws/") else a for a in self.args), self.flag, str(out), *extra]


INFER = Command("infer", "--out", "run.json", ("infer", "--model_config", "ws/tiny.json", "--num_input_tokens", "4",
                                               "--num_output_tokens", "3"))
INFER_TP = Command("infer-tp-meta", "--out", "chakra/tiny-gpt2.1.et", (*INFER.args, "--device", "meta", "--tp", "2",
                                                                      "--chakra"))
TRACE = Command("trace", "--out", "summary.json", ("trace", "--model_config", "ws/tiny.json", "--seq", "16",
                                                   "--no_progress"))
EXPORT = Command("export-chakra", "--output", "comm_groups.json", ("export", "--input", "ws/graph.json", "--format",
                                                                   "chakra"))
TRAIN = Command("train", "--trace-output-dir", "gpt2_1rank.0.et", (
    "train", "gpt2", "--data", "ws/squad.json", "--model-name", "ws/gpt2", "--tokenizer", "ws/tok", "--device", "cpu",
    "--max-seq-length", "32", "--batch-size", "2", "--max-steps", "3", "--save-dir", "ws/ckpt", "--enable-tracing"))
CHEAP = [INFER, INFER_TP, TRACE, EXPORT]
ALL = [*CHEAP, TRAIN]


def ids(commands):
    return [c.name for c in commands]


def recorded(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def on_disk(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p != folder / MANIFEST)


def temporaries(*folders: Path) -> list[Path]:
    return [p for f in folders for p in f.glob(".syntorch-tmp.*")]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("where", ["new folder", "empty current folder"])
@pytest.mark.parametrize("command", CHEAP, ids=ids(CHEAP))
def test_a_run_appears_whole_with_the_list_of_its_files(ws, tmp_path, monkeypatch, command, where):
    out = tmp_path / "runs" / "a"
    if where == "empty current folder":  # was: the folder removed, then EINVAL renaming onto '.'
        out.mkdir(parents=True)
        monkeypatch.chdir(out)
    assert main(command.argv(ws, out if where == "new folder" else ".")) == 0
    assert (out / command.writes).is_file()
    manifest = recorded(out)
    assert manifest["complete"] and manifest["files"] == on_disk(out)
    assert not temporaries(out, out.parent)


@pytest.fixture
def mount_point(tmp_path):
    """An empty tmpfs mounted in tmp_path: a folder on another filesystem that cannot be renamed over."""
    m = tmp_path / "m"
    m.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(m)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); test_an_existing_folder_is_filled_from_inside "
                    "checks where the temporary folder goes")
    assert os.stat(m).st_dev != os.stat(tmp_path).st_dev
    yield m
    subprocess.run(["umount", "-l", str(m)], check=True)


@pytest.mark.parametrize("command", ALL, ids=ids(ALL))
def test_a_mount_point_is_filled_in_place_and_an_earlier_run_replaced_only_with_force(ws, mount_point, capsys,
                                                                                       command):
    assert main(command.argv(ws, mount_point)) == 0  # was: all the work, then EXDEV
    assert (mount_point / command.writes).is_file() and not temporaries(mount_point, mount_point.parent)
    assert recorded(mount_point)["files"] == on_disk(mount_point)
    capsys.readouterr()
    assert main(command.argv(ws, mount_point)) == 2  # infer used to mix the two runs' files
    err = one_line_error(capsys)
    assert f"{command.flag} {mount_point} holds the outputs of an earlier syntorch run; pass --force" in err
    if command is TRAIN:
        return  # its --force run is test_capture's (stale rank files of a larger run)
    stale = "stale.7.et"  # e.g. a rank of a larger earlier run, which would mix with ours
    (mount_point / stale).write_text("old")
    (mount_point / MANIFEST).write_text(json.dumps({"files": [*recorded(mount_point)["files"], stale]}))
    assert main(command.argv(ws, mount_point, "--force")) == 0
    assert not (mount_point / stale).exists() and (mount_point / command.writes).is_file()
    assert recorded(mount_point)["files"] == on_disk(mount_point)


@pytest.mark.parametrize("force", [False, True], ids=["", "--force"])
@pytest.mark.parametrize("command", CHEAP, ids=ids(CHEAP))
def test_a_run_adds_its_files_beside_a_users_and_touches_none(ws, tmp_path, monkeypatch, command, force):
    home = tmp_path / "home"  # the current folder, with the user's notes (the seed writes beside its scripts)
    home.mkdir()
    (home / "notes.txt").write_text("important")
    (home / "sub").mkdir()
    (home / "sub" / "more.txt").write_text("mine too")
    monkeypatch.chdir(home)
    assert main(command.argv(ws, ".", *(["--force"] if force else []))) == 0
    assert (home / command.writes).is_file()
    assert (home / "notes.txt").read_text() == "important" and (home / "sub" / "more.txt").read_text() == "mine too"
    written = recorded(home)["files"]
    assert "notes.txt" not in written and "sub/more.txt" not in written
    assert sorted(written) == [f for f in on_disk(home) if f not in ("notes.txt", "sub/more.txt")]
    assert main(command.argv(ws, ".", "--force")) == 0  # replaces its own files, still not the user's
    assert (home / "notes.txt").read_text() == "important" and recorded(home)["files"] == written


@pytest.mark.parametrize("force", [False, True], ids=["", "--force"])
@pytest.mark.parametrize("command", ALL, ids=ids(ALL))
def test_a_users_file_in_the_way_of_an_output_is_refused(ws, tmp_path, monkeypatch, capsys, command, force):
    home = tmp_path / "home"
    (home / Path(command.writes).parent).mkdir(parents=True)
    (home / command.writes).write_text("important")  # the user's file under a name the run writes
    monkeypatch.chdir(home)
    assert main(command.argv(ws, ".", *(["--force"] if force else []))) == 2
    err = one_line_error(capsys)
    assert f"{command.flag} . holds {command.writes}, which syntorch did not write; move it away" in err
    assert on_disk(home) == [command.writes] and (home / command.writes).read_text() == "important"
    assert not temporaries(home, *home.rglob("*"))


def test_a_lookalike_temporary_name_of_the_users_is_not_swept(tmp_path):
    user = tmp_path / f".syntorch-tmp.{outdir._host()}.999999.mydata"  # a dead pid, but no proof it is ours
    user.mkdir()
    (user / "photo.jpg").write_bytes(b"jpg")
    with atomic_output_dir(tmp_path / "newrun") as tmp:
        (tmp / "x").write_text("x")
    with atomic_output_dir(tmp_path) as tmp:
        (tmp / "y").write_text("y")
    assert (user / "photo.jpg").read_bytes() == b"jpg"


@pytest.mark.parametrize("kind", ["fifo", "manifest"])
def test_a_file_output_never_replaces_a_fifo_or_a_manifest(tmp_path, kind):
    target = tmp_path / ("pipe.svg" if kind == "fifo" else MANIFEST)
    if kind == "fifo":
        os.mkfifo(target)
    with pytest.raises(UserError, match="not a regular file" if kind == "fifo" else "syntorch's record"):
        with outdir.atomic_output_file(target):
            pass
    assert (os.path.exists(target) and not target.is_file()) if kind == "fifo" else not target.exists()


def test_an_unnamed_file_replaces_only_its_own(tmp_path):
    (tmp_path / "train_log.json").write_text("the user's")
    with pytest.raises(UserError, match="holds train_log.json, which syntorch did not write"):
        with outdir.atomic_output_file(tmp_path / "train_log.json", "--save-dir", named=False):
            pass
    (tmp_path / "train_log.json").unlink()
    for text in ("first", "second"):  # the first run's file is recorded, so the second may replace it
        with outdir.atomic_output_file(tmp_path / "train_log.json", "--save-dir", named=False) as tmp:
            tmp.write_text(text)
    assert (tmp_path / "train_log.json").read_text() == "second"


def test_force_never_removes_the_commands_own_inputs(ws, tmp_path, capsys):
    run = tmp_path / "run"
    assert main([*TRACE.argv(ws, run), "--dp", "2"]) == 0
    inputs = sorted(p.name for p in run.glob("*.et"))
    capsys.readouterr()
    assert inputs and main(["predict", str(run), "--out", str(run), "--force"]) == 2
    assert "which this command reads" in one_line_error(capsys)
    assert sorted(p.name for p in run.glob("*.et")) == inputs


def test_train_keeps_checkpoints_out_of_the_trace_folder(ws, tmp_path, capsys):
    argv = TRAIN.argv(ws, tmp_path / "traces", "--save-dir", str(tmp_path / "traces" / "ckpt"))
    assert main(argv) == 2  # else the first checkpoint would make the trace folder hold files not of its run
    assert "--save-dir" in one_line_error(capsys) and not (tmp_path / "traces").exists()


def test_an_interrupted_command_leaves_nothing(ws, tmp_path, monkeypatch, capsys):
    def interrupt(*_):
        raise KeyboardInterrupt
    monkeypatch.setattr("syntorch.inference.run.write_run_json", interrupt)
    assert main(INFER.argv(ws, tmp_path / "out")) == 130
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
def test_an_exception_removes_the_temporary_folder_and_touches_nothing(tmp_path, existing):
    out = tmp_path / "out"
    if existing:
        with atomic_output_dir(out) as tmp:
            (tmp / "a.txt").write_text("earlier")
    with pytest.raises(KeyboardInterrupt), atomic_output_dir(out, force=True) as tmp:
        (tmp / "a.txt").write_text("later")
        raise KeyboardInterrupt
    assert not temporaries(tmp_path, *([out] if existing else []))
    assert (out / "a.txt").read_text() == "earlier" if existing else not out.exists()


def test_an_existing_folder_is_filled_from_inside(tmp_path):
    # a temporary folder beside it may be on another filesystem (a mount point's parent), one inside never is
    (tmp_path / "out").mkdir()
    with atomic_output_dir(tmp_path / "out") as tmp:
        assert tmp.parent == tmp_path / "out"
        (tmp / "x").write_text("x")
    with atomic_output_dir(tmp_path / "new") as tmp:
        assert tmp.parent == tmp_path
        (tmp / "x").write_text("x")
    assert recorded(tmp_path / "out")["files"] == recorded(tmp_path / "new")["files"] == ["x"]


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from syntorch.outdir import atomic_output_dir
    with atomic_output_dir(sys.argv[1]) as tmp:
        (tmp / "half.et").write_text("half")
        print(tmp, flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
def test_a_killed_writers_temporary_folder_is_removed_by_the_next_run(ws, tmp_path, existing):
    out = tmp_path / "out"
    if existing:
        out.mkdir()
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(out)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    left = Path(writer.stdout.readline().strip())
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert left.is_dir() and left.parent == (out if existing else tmp_path)
    assert main(INFER.argv(ws, out)) == 0
    assert not left.exists() and not temporaries(tmp_path, out)
    assert recorded(out)["files"] == ["run.json"]


def test_live_and_other_hosts_temporaries_are_kept(tmp_path):
    live = tmp_path / outdir._tmp_name()
    other = "otherhost.999999999.0123abcd"
    elsewhere = tmp_path / f".syntorch-tmp.{other}.{outdir._check(other)}"  # its host alone can tell if it is gone
    live.mkdir()
    elsewhere.mkdir()
    with atomic_output_dir(tmp_path / "out") as tmp:
        (tmp / "x").write_text("x")
    assert live.is_dir() and elsewhere.is_dir()


def test_force_removes_nothing_outside_the_folder_or_behind_a_link(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST).write_text(json.dumps({"files": ["../victim.txt"]}))  # not one syntorch writes
    with pytest.raises(UserError, match=f"holds {MANIFEST}, which syntorch did not write"):
        with atomic_output_dir(out, force=True):
            pass
    (out / MANIFEST).write_text(json.dumps({"files": ["sub/victim.txt"]}))
    (out / "sub").symlink_to(tmp_path)  # the recorded file now lies behind a link: not ours to remove
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert victim.read_text() == "keep" and (out / "sub").is_symlink()


def test_a_crash_while_moving_in_leaves_every_file_recorded(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    with atomic_output_dir(out) as tmp:
        (tmp / "old.et").write_text("old")

    def crash(*_):
        raise OSError("disk full")
    with monkeypatch.context() as m:
        m.setattr(outdir, "_move_into", crash)
        with pytest.raises(OSError), atomic_output_dir(out, force=True) as tmp:
            (tmp / "new.et").write_text("new")
    manifest = recorded(out)
    assert not manifest["complete"] and manifest["files"] == ["new.et", "old.et"]  # a superset: --force clears it
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "new.et").write_text("new")
    assert recorded(out) == {**manifest, "complete": True, "files": ["new.et"]} and on_disk(out) == ["new.et"]


def test_a_file_output_replaces_the_named_file_refuses_a_folder_and_joins_a_run(ws, tmp_path, capsys):
    png = ["export", "--input", str(ws / "graph.json"), "--format", "png", "--output"]
    (tmp_path / "g.png").write_text("an older picture")
    assert main([*png, str(tmp_path / "g.png")]) == 0  # the user named this file: replaced, as cp would
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG" and not temporaries(tmp_path)
    (tmp_path / "pictures.png").mkdir()
    assert main([*png, str(tmp_path / "pictures.png")]) == 2
    assert f"--output {tmp_path / 'pictures.png'} is a folder; give a file name" in one_line_error(capsys)
    assert main(EXPORT.argv(ws, tmp_path / "run")) == 0
    json_form = ["export", "--input", str(ws / "graph.json"), "--format", "json", "--output"]
    assert main([*json_form, str(tmp_path / "run" / "g.json")]) == 0
    assert "g.json" in recorded(tmp_path / "run")["files"]  # so the run's --force replaces it, as syntorch's
    assert main(EXPORT.argv(ws, tmp_path / "run", "--force")) == 0
    assert not (tmp_path / "run" / "g.json").exists()


def test_a_full_disk_is_one_line_naming_the_output_and_leaves_nothing(ws, tmp_path, monkeypatch, capsys):
    """ENOSPC while a run writes (patched into the graph export: no size-limited filesystem needed)."""
    import errno

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("syntorch.export.networkx_json.export", full)
    out = tmp_path / "run"
    assert main([*INFER.argv(ws, out), "--visualize_trace"]) == 2
    assert f"cannot write --out {out}: No space left on device" in one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []


def test_a_size_limited_mount_fills_and_says_so(ws, mount_point, capsys):
    """A real ENOSPC: a 64 KiB tmpfs cannot hold an SVG of the graph; the file output is refused whole."""
    subprocess.run(["mount", "-o", "remount,size=64k", str(mount_point)], check=True)
    assert main(["export", "--input", str(ws / "graph.json"), "--output", str(mount_point / "g.svg")]) == 2
    assert f"cannot write --output {mount_point / 'g.svg'}: No space left on device" in one_line_error(capsys)
    assert list(mount_point.iterdir()) == []
