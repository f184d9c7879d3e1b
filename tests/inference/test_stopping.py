"""Stopping a spawned multi-rank run: a rank killed or stopped, the launcher interrupted or terminated.

Each test runs the real CLI (2 gloo ranks on CPU, a tiny model and a long generation or training, so the
run is still going when the test signals), then checks the time bound, the one-line message, the exit
code, that no rank survives (psutil) and that no temporary folder is left beside the output. A rank is
signaled while main() runs in this process; the launcher is signaled as a subprocess."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from syntorch.cli import main
from syntorch.config import save_model_config
from syntorch.parallel.launch import FROZEN_AFTER_S, HEARTBEAT_S, HUNG_AFTER_S, _unresponsive
from conftest import tiny_config

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-c", "from syntorch.cli import run_main; run_main()"]
SLACK_S = 3.0  # launcher reaction, teardown and exit on a loaded 2-core machine


def start(argv, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # a process group of its own, as a shell gives a command, with Ctrl-C's default action: a suite started in the
    # background by a shell without job control inherits SIGINT ignored, which Python keeps (the CLI then never sees it)
    return subprocess.Popen(CLI + argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def infer_args(tmp_path):
    """TP 2 generating 8000 tokens of a tiny GPT-2: over a minute, far longer than any test waits."""
    save_model_config(tiny_config("gpt2", n_positions=8192), tmp_path / "tiny.json")
    return ["infer", "--model_config", str(tmp_path / "tiny.json"), "--tp", "2", "--num_input_tokens", "4",
            "--num_output_tokens", "8000", "--out", str(tmp_path / "out")]


def train_args(tmp_path):
    """2-rank DDP training of a tiny GPT-2 under the profiler, for far more steps than any test waits."""
    from tests.train.test_train import make_model, make_squad, make_tokenizer  # imports transformers: only this test pays

    make_squad(tmp_path / "squad.json", articles=3)
    make_tokenizer(tmp_path / "tok")
    make_model(tmp_path / "gpt2", "gpt2")
    return ["train", "gpt2", "--data", str(tmp_path / "squad.json"), "--model-name", str(tmp_path / "gpt2"),
            "--tokenizer", str(tmp_path / "tok"), "--device", "cpu", "--nproc", "2", "--batch-size", "2",
            "--max-seq-length", "32", "--max-steps", "100000", "--num-epochs", "100000",
            "--save-dir", str(tmp_path / "ckpt"), "--enable-tracing", "--trace-output-dir", str(tmp_path / "tr_out")]


def running_ranks(launcher: int, ready=lambda: True, timeout=120):
    """The 2 ranks the process `launcher` spawned, in rank order (started in that order), once both talk to
    each other over gloo and `ready()` holds."""
    parent = psutil.Process(launcher)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = [p for p in parent.children() if "spawn_main" in " ".join(p.cmdline())]
        if len(ranks) == 2 and all(_connected(p) for p in ranks) and ready():
            return sorted(ranks, key=lambda p: (p.create_time(), p.pid))
        time.sleep(0.1)
    raise TimeoutError("the ranks did not start")


def _connected(proc) -> bool:
    return any(c.status == psutil.CONN_ESTABLISHED for c in proc.net_connections("tcp"))


def main_signaling_rank_1(argv, sig, ready=lambda: True):
    """Run the CLI's main(argv) here while a thread sends `sig` to rank 1 once the ranks run.
    Returns (exit code, the ranks, seconds from the signal to main's return)."""
    signaled = {}

    def signal_rank_1():
        signaled["ranks"] = running_ranks(os.getpid(), ready)
        signaled["ranks"][1].send_signal(sig)
        signaled["at"] = time.monotonic()

    thread = threading.Thread(target=signal_rank_1, daemon=True)
    thread.start()
    code = main(argv)
    took = time.monotonic() - signaled["at"]
    thread.join()
    return code, signaled["ranks"], took


def assert_nothing_left(ranks, folder):
    assert not [p.pid for p in ranks if p.is_running()], "a rank survived the launcher"
    assert not list(Path(folder).glob(".syntorch-tmp.*")), "a temporary output was left"


def test_a_killed_rank_ends_the_run_at_once_naming_it(tmp_path, capsys):
    code, ranks, took = main_signaling_rank_1(infer_args(tmp_path), signal.SIGKILL)
    assert (code, capsys.readouterr().err) == (2, "syntorch infer: error: rank 1 was killed by SIGKILL\n")
    assert took < SLACK_S, took
    assert_nothing_left(ranks, tmp_path)
    assert not (tmp_path / "out").exists()


def test_a_stopped_rank_ends_the_run_within_the_heartbeat_bound(tmp_path, capsys):
    code, ranks, took = main_signaling_rank_1(infer_args(tmp_path), signal.SIGSTOP)
    assert (code, capsys.readouterr().err) == (2, f"syntorch infer: error: rank 1 is stopped (SIGSTOP or a debugger): "
                                                  f"no heartbeat for {HUNG_AFTER_S:g} s\n")
    assert HUNG_AFTER_S - HEARTBEAT_S <= took < HUNG_AFTER_S + SLACK_S, took  # the last beat came before the stop
    assert_nothing_left(ranks, tmp_path)


def test_a_silent_running_rank_counts_as_frozen_only_after_the_longer_bound():
    """Without a real 30 s wait: this process is running, not stopped, so 6 s of silence (a C call holding the
    GIL) is tolerated, 31 s is not, and time the launcher itself was stopped does not count."""
    me, beat = os.getpid(), 100.0
    assert _unresponsive(1, me, beat, awake_since=0.0, now=beat + HUNG_AFTER_S + 1) is None
    assert _unresponsive(1, me, beat, awake_since=0.0, now=beat + FROZEN_AFTER_S + 1) == \
        f"rank 1 stopped responding: no heartbeat for {FROZEN_AFTER_S:g} s"
    assert _unresponsive(1, me, beat, awake_since=beat + FROZEN_AFTER_S, now=beat + FROZEN_AFTER_S + 1) is None
    assert _unresponsive(1, me, 0.0, awake_since=0.0, now=1.0) is None  # still importing torch


def test_a_killed_training_rank_is_reported_as_in_inference_and_its_traces_removed(tmp_path, capsys):
    def in_capture():  # both ranks are inside their capture once both write their host traces (into rank 0's folder)
        return len(list(tmp_path.glob(".syntorch-tmp.*/*_host.*.json"))) == 2

    code, ranks, took = main_signaling_rank_1(train_args(tmp_path), signal.SIGKILL, in_capture)
    assert (code, capsys.readouterr().err) == (2, "syntorch train: error: rank 1 was killed by SIGKILL\n")
    assert took < SLACK_S, took
    assert_nothing_left(ranks, tmp_path)
    assert not (tmp_path / "tr_out").exists()


# Ctrl-C sends SIGINT to the launcher and to the ranks, which ignore it: for the ranks the same as
# `kill -INT PID`, and it also checks that no rank prints a KeyboardInterrupt traceback
@pytest.mark.parametrize("sig, to_group, code, message", [(signal.SIGINT, True, 130, "interrupted"),
                                                           (signal.SIGTERM, False, 143, "terminated")],
                         ids=["Ctrl-C", "kill PID"])
def test_a_signaled_launcher_stops_every_rank_within_3s_and_removes_its_output(tmp_path, sig, to_group, code, message):
    """The CLI in a subprocess (its own process group), signaled while its ranks generate."""
    launcher = start(infer_args(tmp_path), tmp_path)
    try:
        ranks = running_ranks(launcher.pid)
        assert list(tmp_path.glob(".syntorch-tmp.*"))  # the run's temporary output, to be removed
        if to_group:
            os.killpg(launcher.pid, sig)
        else:
            launcher.send_signal(sig)
        signaled_at = time.monotonic()
        psutil.wait_procs(ranks, timeout=10)
        ranks_gone = time.monotonic() - signaled_at
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()  # a hung launcher must not outlive the test (no-op once it has exited)
    assert (launcher.returncode, err) == (code, f"syntorch infer: {message}\n")  # and no rank's traceback
    assert ranks_gone < 3.0, ranks_gone
    assert_nothing_left(ranks, tmp_path)
    assert not (tmp_path / "out").exists()
