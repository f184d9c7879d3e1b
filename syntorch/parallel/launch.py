"""Start N local ranks the way torchrun does, or join the ones torchrun started.

Every rank sees RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, so the same code runs under
`torchrun --nproc_per_node=N` and under `--nproc N` / `--tp N` where syntorch spawns the processes itself.
When syntorch spawns them, the launcher hosts the rendezvous store (a TCPStore on a port the OS assigns) for the
whole run and the ranks join it as clients, as torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE): a port
picked free, released and bound again later by rank 0 could be taken by another process in between.

How a spawned run stops. The launcher (spawn) watches every rank and ends the run, with every rank reaped,
when one of these happens, raising RankFailed with one line that names the rank:
- a rank raises: the first rank to raise is named (the others only saw their peer vanish);
- a rank dies (SIGKILL, the OOM killer): seen at once from its exit;
- a rank stops responding: a thread in each rank stamps a heartbeat every HEARTBEAT_S (0.5 s). A silent
  rank that the OS shows stopped (SIGSTOP, a debugger) ends the run HUNG_AFTER_S (5 s) after its last beat,
  one silent although running (frozen) after FROZEN_AFTER_S (30 s), where its peers would otherwise block in
  a collective (until its 300 s timeout at best). Time the launcher itself spent stopped (Ctrl-Z, then fg)
  does not count;
- the launcher is interrupted (KeyboardInterrupt, or the CLI's SIGTERM exception): every rank is stopped at
  once (well under 3 s) and the exception goes on up, so the caller's `finally` blocks remove its outputs.
Ranks are stopped with SIGKILL: one blocked in a collective or stopped acts on nothing gentler. The temporary
outputs they had open (outdir notes them in the run folder) are then removed by the launcher. Ranks ignore
SIGINT (Ctrl-C reaches the whole process group; the launcher decides) and die with the launcher
(PR_SET_PDEATHSIG), so none outlives it even when it is SIGKILLed. Under torchrun, torchrun's agent watches
the ranks; a stopped peer is then found only by the collective timeout (init_distributed, 300 s).
"""
import contextlib
import datetime
import glob
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from multiprocessing.connection import wait

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from syntorch.errors import RankFailed, UserError
from syntorch.outdir import TEMP_LOG_ENV

HEARTBEAT_S = 0.5  # how often each rank stamps its heartbeat; a busy rank still beats (torch ops release the GIL)
HUNG_AFTER_S = 5.0  # a rank silent this long that the OS shows stopped is gone
FROZEN_AFTER_S = 30.0  # a rank silent this long although running is gone (frozen, or deadlocked holding the GIL)
STARTUP_S = 120.0  # a rank's first beat comes after Python started and imported torch: slow on a loaded machine
POLL_S = 0.25  # how often the launcher looks at the heartbeats


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def check_devices(device: str, world_size: int) -> None:
    if torch.device(device).type != "cuda":
        return
    if not torch.cuda.is_available():
        raise UserError("--device cuda was given but CUDA is not available here; use --device cpu or meta")
    if torch.cuda.device_count() < world_size:
        raise UserError(f"{world_size} ranks need {world_size} GPUs but {torch.cuda.device_count()} are visible; "
                        "lower the parallel degree or use --device cpu")


def init_distributed(device: str, timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the process group described by the torchrun environment; returns (rank, world_size)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world


def spawn(fn, world_size: int, args: tuple = ()) -> None:
    """Run fn(*args) in `world_size` local processes with torchrun's environment; return when all succeed.

    Raises RankFailed when a rank raises, dies or stops responding (see the module docstring for the time
    bounds); whatever ends the call, every rank is gone when it returns or raises. fn must be a picklable
    top-level function.
    """
    ctx = mp.get_context("spawn")
    beats = ctx.RawArray("d", world_size)  # per rank: time.monotonic() of its last heartbeat, 0 before the first
    with tempfile.TemporaryDirectory(prefix="syntorch-ranks-") as run_dir, _rendezvous_store() as port:
        rank_args = (world_size, port, run_dir, beats, os.getpid(), fn, args)
        procs = [ctx.Process(target=_entry, args=(rank, *rank_args), name=f"rank {rank}") for rank in range(world_size)]
        try:
            _start(procs)
            _supervise(procs, beats, run_dir)
        finally:
            _stop(procs)
            _remove_temporaries(run_dir)


@contextlib.contextmanager
def _rendezvous_store():
    """Host the ranks' rendezvous store here, bound to a port the OS assigns, and give that port. It closes when
    the `with` ends, which in spawn is after every rank (its clients) is gone, however the run ended."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store  # closes the port now, not whenever a traceback holding this frame goes


def _start(procs) -> None:
    """Start the ranks with SIGINT ignored, which they keep from their first instruction (Python leaves an
    inherited SIG_IGN alone): Ctrl-C reaches the whole process group, and the launcher alone decides."""
    in_main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    try:
        for p in procs:
            p.start()
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)


def _entry(rank, world_size, port, run_dir, beats, launcher, fn, args):
    mp._prctl_pr_set_pdeathsig(signal.SIGKILL)  # die with the launcher, even a SIGKILLed one ...
    if os.getppid() != launcher:  # ... also when it died before the line above
        os._exit(1)
    threading.Thread(target=_beat, args=(beats, rank), daemon=True).start()
    # TORCHELASTIC_USE_AGENT_STORE: env:// then joins the launcher's store at MASTER_PORT instead of rank 0 hosting one
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True",
                      **{TEMP_LOG_ENV: os.path.join(run_dir, f"temp.{rank}")})
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        fn(*args)
    except BaseException as e:  # a one-line report for the launcher instead of a traceback on stderr
        # a user's mistake reads the same from every rank: its own line; anything else names the rank
        text = str(e) if isinstance(e, UserError) else f"rank {rank} failed: {type(e).__name__}" + (f": {e}" if str(e) else "")
        with open(os.path.join(run_dir, f"error.{time.time_ns()}.{rank}"), "w") as f:
            f.write(text.splitlines()[0])
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _beat(beats, rank: int) -> None:
    while True:
        beats[rank] = time.monotonic()
        time.sleep(HEARTBEAT_S)


def _supervise(procs, beats, run_dir: str) -> None:
    """Return once every rank has exited 0; raise RankFailed at the first rank that fails, dies or goes silent."""
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    awake_since = checked = time.monotonic()
    while running:
        exited = [running.pop(s) for s in wait(list(running), timeout=POLL_S)]
        for rank in exited:
            procs[rank].join()
        failed = [rank for rank in exited if procs[rank].exitcode != 0]
        if failed:
            raise RankFailed(_cause(procs, failed, run_dir))
        now = time.monotonic()
        if now - checked > HUNG_AFTER_S:  # the launcher was stopped too (Ctrl-Z, then fg): silence counts from now
            awake_since = now
        checked = now
        for rank in running.values():
            if problem := _unresponsive(rank, procs[rank].pid, beats[rank], awake_since, now):
                raise RankFailed(problem)


def _unresponsive(rank: int, pid: int, last_beat: float, awake_since: float, now: float) -> str | None:
    """Why a rank whose process exists counts as gone, or None. A silent rank that the OS shows stopped is gone
    after HUNG_AFTER_S; a silent running one only after FROZEN_AFTER_S, as a C call that holds the GIL (json's
    encoder on a huge trace) also silences the heartbeat for a while."""
    if not last_beat:
        return f"rank {rank} did not start within {STARTUP_S:g} s" if now - awake_since > STARTUP_S else None
    silent = now - max(last_beat, awake_since)
    if silent > HUNG_AFTER_S and _stopped(pid):
        return f"rank {rank} is stopped (SIGSTOP or a debugger): no heartbeat for {HUNG_AFTER_S:g} s"
    if silent > FROZEN_AFTER_S:
        return f"rank {rank} stopped responding: no heartbeat for {FROZEN_AFTER_S:g} s"
    return None


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.NoSuchProcess:  # it just exited: its exit code tells
        return False


def _cause(procs, failed: list[int], run_dir: str) -> str:
    """What ended the run: a rank killed by a signal (ranks never signal each other, so it came from outside),
    else the earliest report a rank wrote (the others only saw their peer vanish), else an exit code."""
    for rank in failed:
        if procs[rank].exitcode < 0:
            return f"rank {rank} was killed by {_signal_name(-procs[rank].exitcode)}"
    reports = sorted((int(when), rank, name) for name in os.listdir(run_dir) if name.startswith("error.")
                     for _, when, rank in [name.split(".")])
    if reports:
        _, rank, name = reports[0]
        with open(os.path.join(run_dir, name)) as f:
            return f.read()
    return f"rank {failed[0]} exited with code {procs[failed[0]].exitcode}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _stop(procs) -> None:
    """SIGKILL the ranks still running and reap them all."""
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.is_alive():
            p.kill()
    for p in started:
        p.join()


def _remove_temporaries(run_dir: str) -> None:
    """Remove the temporary outputs that ranks noted (outdir.TEMP_LOG_ENV) and did not get to remove: a killed
    rank runs no `finally`. After a success the list names only paths already renamed or removed."""
    for log in glob.glob(os.path.join(run_dir, "temp.*")):
        with open(log) as f:
            for path in filter(None, f.read().split("\0")):
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif os.path.lexists(path):
                    os.unlink(path)
