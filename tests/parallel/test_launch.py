"""spawn's rendezvous port: the launcher itself holds it, from before the ranks start until they are all gone, so
no other process can take it between a pick and rank 0's bind (a port picked free and released could be), and it
is closed again however the run ends."""
import errno
import os
import signal
import socket
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from syntorch.errors import RankFailed
from syntorch.parallel.launch import init_distributed, spawn


def listening(pid: int) -> set[int]:
    return {c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def port_rank(out: str) -> None:
    """Before joining the group, report whether MASTER_PORT is taken and whether the launcher listens on it; then
    check the group works with an all-reduce."""
    port = int(os.environ["MASTER_PORT"])
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            taken = False
        except OSError as e:
            taken = e.errno == errno.EADDRINUSE
    by_launcher = port in listening(os.getppid())
    rank, _ = init_distributed("cpu")
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(f"{port} {taken} {by_launcher} {total.item():g}")


def test_the_launcher_holds_the_port_for_the_whole_run_and_then_closes_it(tmp_path):
    before = listening(os.getpid())
    spawn(port_rank, 2, (str(tmp_path),))
    reports = [(tmp_path / f"rank{rank}").read_text().split() for rank in range(2)]
    port = reports[0][0]
    assert reports == [[port, "True", "True", "3"]] * 2  # 1 + 2 summed over the two ranks
    assert listening(os.getpid()) == before


def ending_rank(how: str) -> None:
    rank, _ = init_distributed("cpu")
    if rank == 1 and how == "raise":
        raise RuntimeError("boom")
    if rank == 1 and how == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0 and how == "ctrl-c":  # the launcher runs its supervision loop by now: both ranks have joined
        os.kill(os.getppid(), signal.SIGINT)
        time.sleep(60)  # the launcher kills this rank long before


@pytest.mark.parametrize("how, error, message", [("raise", RankFailed, "rank 1 failed: RuntimeError: boom"),
                                                 ("die", RankFailed, "rank 1 was killed by SIGKILL"),
                                                 ("ctrl-c", KeyboardInterrupt, None)])
def test_the_port_is_closed_however_the_run_ends(how, error, message):
    before = listening(os.getpid())
    with pytest.raises(error, match=message) as raised:  # its traceback, alive here, holds spawn's frames
        spawn(ending_rank, 2, (how,))
    assert raised.traceback and listening(os.getpid()) == before
