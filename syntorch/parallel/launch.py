"""Start N local ranks the way torchrun does, or join the ones torchrun started.

Every rank sees RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, so the same code runs under
`torchrun --nproc_per_node=N` and under `--nproc N` / `--tp N` where syntorch spawns the processes itself.
"""
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from syntorch.errors import RankFailed, UserError


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    import datetime
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world


def _entry(rank, world_size, port, error_dir, fn, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        fn(*args)
    except BaseException as e:
        # the first rank to fail is the cause; the others only see their peer vanish
        with open(os.path.join(error_dir, f"{time.time():.6f}.{rank}"), "w") as f:
            f.write(f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world_size: int, args: tuple = ()) -> None:
    """Run fn(*args) in `world_size` local processes with torchrun's environment.

    If any rank fails, every other rank is terminated at once (no hang in a collective) and RankFailed
    says which rank failed and why. fn must be a picklable top-level function.
    """
    with tempfile.TemporaryDirectory(prefix="syntorch-ranks-") as error_dir:
        try:
            mp.start_processes(_entry, args=(world_size, free_port(), error_dir, fn, args), nprocs=world_size,
                               join=True, start_method="spawn")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            raise RankFailed(_first_failure(error_dir, e)) from None


def _first_failure(error_dir: str, e: Exception) -> str:
    reports = sorted(os.listdir(error_dir), key=lambda n: float(n.rsplit(".", 1)[0]))
    if reports:
        with open(os.path.join(error_dir, reports[0])) as f:
            return f"rank {reports[0].rsplit('.', 1)[1]} failed: {f.read()}"
    code = getattr(e, "exit_code", None)
    return f"rank {e.error_index} died" + (f" with exit code {code}" if code is not None else "")
