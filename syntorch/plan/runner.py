"""Where the search's predictions run: in this process, in local worker processes (multiprocessing.Pool,
whose terminate() ends them at once on Ctrl-C or SIGTERM), or as Ray tasks (`--ray ADDRESS`, `auto` for a
running cluster; a Ray instance this process already started is used as it is). Each task is one probe key's jobs
(evaluate.evaluate_group); results come back keyed by job index, so any runner gives the same rows in the
same order.
"""
import multiprocessing
import os
import signal

from syntorch.errors import UserError
from syntorch.plan.evaluate import evaluate_group


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_tasks(args: tuple, groups: list[list[tuple]], workers: int = 1, ray_address: str | None = None,
              advance=lambda n: None) -> dict:
    """{job index: (summary or None, refusal or None)} of every job of `groups`; `args` = evaluate_group's
    leading (config, dtype, profile, attention); `advance(n)` after each finished group of n jobs."""
    if ray_address:
        results = _on_ray(args, groups, ray_address, advance)
    elif workers > 1 and len(groups) > 1:
        results = _on_pool(args, groups, workers, advance)
    else:
        results = []
        for group in groups:
            results.append(evaluate_group(*args, group))
            advance(len(group))
    return {index: (summary, refusal) for out in results for index, summary, refusal in out}


def _one_thread() -> None:
    import torch
    torch.set_num_threads(1)  # the workers are the parallelism; tracing on meta gains nothing from threads


def _worker_init() -> None:
    """A worker ends at once on SIGTERM (Pool.terminate, when the search ends or fails) and leaves Ctrl-C to
    the command, which then terminates the pool (the CLI's own handlers would make a worker finish its task)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _one_thread()


def _pool_group(task: tuple) -> list:
    args, group = task
    return evaluate_group(*args, group)


# tasks a worker process runs before a fresh one (forked from the search) takes its place: what a process keeps
# across tasks (the meta cache's results, torch's own caches) grows with the layouts it saw. (Until stop 31 the
# gradient hooks also kept every probed stage alive, ~130 MB a 405B task: tests/trace/test_probe_frees.py.)
TASKS_PER_WORKER = 16


def _on_pool(args, groups, workers, advance) -> list:
    results = []
    with multiprocessing.Pool(min(workers, len(groups)), initializer=_worker_init,
                              maxtasksperchild=TASKS_PER_WORKER) as pool:  # exit: terminate
        for out in pool.imap_unordered(_pool_group, [(args, group) for group in groups]):
            results.append(out)
            advance(len(out))
    return results


def _ray_group(*args):
    _one_thread()
    return evaluate_group(*args)


def _on_ray(args, groups, address, advance) -> list:
    try:
        import ray
    except ImportError:
        raise UserError("--ray needs Ray: pip install -e '.[cluster]' (or pip install ray)") from None
    if not ray.is_initialized():
        try:
            ray.init(address=address, log_to_driver=False)
        except ConnectionError as e:
            raise UserError(f"--ray {address}: no Ray cluster there ({e}); start one with `ray start --head`") from None
    task = ray.remote(num_cpus=1)(_ray_group)
    shared = [ray.put(a) for a in args]
    pending = {task.remote(*shared, group): len(group) for group in groups}
    results, waiting = [], list(pending)
    while waiting:
        done, waiting = ray.wait(waiting, num_returns=1)
        results.append(ray.get(done[0]))
        advance(pending[done[0]])
    return results
