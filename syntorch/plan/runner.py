"""Where the search's predictions run: in this process, in local worker processes
(concurrent.futures.ProcessPoolExecutor), or as Ray tasks (`--ray ADDRESS`, `auto` for a running cluster; a
Ray instance this process already started is used as it is). Each task is one probe key's jobs
(evaluate.evaluate_group); results come back keyed by job index, so any runner gives the same rows in the
same order.
"""
import os
from concurrent.futures import ProcessPoolExecutor, as_completed

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


def _on_pool(args, groups, workers, advance) -> list:
    with ProcessPoolExecutor(max_workers=min(workers, len(groups)), initializer=_one_thread) as pool:
        futures = {pool.submit(evaluate_group, *args, group): len(group) for group in groups}
        results = []
        for future in as_completed(futures):
            results.append(future.result())
            advance(futures[future])
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
