"""The layout search: enumerate and prune (space.py), predict what is left from shared probes (evaluate.py,
runner.py), rank by predicted step.

    result = search(config, Work(gpus=1024, global_batch=1536, seq=2048), Choices(tp=(8,)), [hw])
    result.rows[0]  # the fastest layout: its degrees, step, tokens/s per GPU, MFU, memory per rank, ...

Layouts are ranked per machine by predicted step, then memory per rank, then enumeration order; the rows of
every machine are in one list, each machine's in its own rank order.
"""
import dataclasses
from dataclasses import dataclass, field

from syntorch.config import ModelConfig, torch_dtype
from syntorch.errors import UserError
from syntorch.hardware import HardwareConfig
from syntorch.parallel.fp8 import check_fp8
from syntorch.parallel.memory import GB
from syntorch.parallel.plans import TrainPlan
from syntorch.plan.evaluate import share_key
from syntorch.plan.runner import run_tasks
from syntorch.plan.space import ADVICE, RULES, Choices, MemoryModel, Work, layers_text, layouts, least_recompute
from syntorch.trace.training import COST_MICROBATCHES, traced_stage_for


@dataclass
class Result:
    config: ModelConfig
    work: Work
    hws: list[HardwareConfig]
    enumerated: int  # applicable layouts (space.py), before any rule
    pruned: dict  # rule -> layouts pruned; per machine ({hw name: count}) for "memory" and "recompute"
    rows: list[dict] = field(default_factory=list)  # every evaluated layout, ranked per machine
    refused: list[dict] = field(default_factory=list)  # layouts the prediction refused, with the reason
    probes: int = 0  # groups of layouts that may share probes (evaluate.share_key)

    def best(self, hw_name: str, k: int = 1) -> list[dict]:
        return [r for r in self.rows if r["hw"] == hw_name][:k]


def search(config: ModelConfig, work: Work, choices: Choices, hws: list[HardwareConfig], dtype: str = "bf16",
           max_memory_gb: float | None = None, profile: str = "fused", attention: str = "flash", workers: int = 1,
           ray_address: str | None = None, progress: bool = False, all_recompute: bool = False) -> Result:
    """Every feasible layout of `config` for `work` on each of `hws`, predicted and ranked (module docstring);
    `all_recompute`: also those recomputing more than they need to fit (space.least_recompute).
    A search with nothing left to predict is refused in one line naming the rule that pruned the last ones."""
    check_work(config, work, dtype, hws)
    pruned = {}
    plans = layouts(config, work, choices, pruned, fp8=dtype == "fp8")
    enumerated = len(plans) + sum(pruned.values())
    model = MemoryModel(config, torch_dtype(dtype))
    peaks = [model.peak(plan) for plan in plans]
    jobs = fitting(plans, peaks, hws, max_memory_gb, all_recompute, pruned)
    if not jobs:
        raise UserError(no_feasible(config, work, enumerated, pruned, min(peaks, default=None)))
    groups = {}  # layouts that may share probes, predicted one after another by one worker (evaluate.py)
    for index, (plan, hw, _) in enumerate(jobs):
        groups.setdefault(share_key(config, plan, torch_dtype(dtype)), []).append((index, plan, hw))
    args = (config, str(torch_dtype(dtype)).removeprefix("torch."), profile, attention)
    # the largest tasks first, so the workers finish together (results do not depend on the order)
    split = {}
    tasks = sorted(groups.values(), key=lambda group: -sum(traced_layers(config, plan, split) for _, plan, _ in group))
    with _progress(progress, len(jobs)) as advance:
        results = run_tasks(args, tasks, workers, ray_address, advance)
    result = Result(config, work, hws, enumerated, pruned, probes=len(groups))
    for index, (plan, hw, peak) in enumerate(jobs):
        summary, refusal = results[index]
        if summary is None:
            result.refused.append({**layout_fields(config, plan), "hw": hw.name, "reason": refusal})
        else:
            result.rows.append(make_row(config, work, plan, hw, peak, summary, index))
    rank(result)
    return result


def fitting(plans: list[TrainPlan], peaks: list[int], hws: list[HardwareConfig], max_memory_gb: float | None,
            all_recompute: bool, pruned: dict) -> list[tuple]:
    """(plan, machine, peak bytes) of each plan that fits each machine (the least recomputation that does,
    unless `all_recompute`); the others counted per machine in `pruned`."""
    jobs = []
    pruned["memory"], pruned["recompute"] = {}, {}
    for hw in hws:
        limit = (max_memory_gb or hw.memory_gb) * GB
        fits = [(plan, peak) for plan, peak in zip(plans, peaks) if peak <= limit]
        kept = fits if all_recompute else least_recompute(fits)
        pruned["memory"][hw.name], pruned["recompute"][hw.name] = len(plans) - len(fits), len(fits) - len(kept)
        jobs += [(plan, hw, peak) for plan, peak in kept]
    return jobs


def rank(result: Result) -> None:
    """Each machine's rows by step, then memory per rank, then enumeration order, numbered from 1."""
    order = {hw.name: i for i, hw in enumerate(result.hws)}
    result.rows.sort(key=lambda r: (order[r["hw"]], r["step_s"], r["memory_gb"], r["index"]))
    for hw in result.hws:
        for i, row in enumerate(r for r in result.rows if r["hw"] == hw.name):
            row["rank"] = i + 1


def traced_layers(config: ModelConfig, plan: TrainPlan, split: dict) -> int:
    """Layer passes a plan's probes trace: what a task costs, roughly. `split`: the layers of the stages traced
    per pipeline split already seen (finding them costs a plan.stage per stage: ~0.5 s over 1,067 layouts)."""
    key = (plan.pp, plan.virtual_stages, plan.layout, plan.moe_load)
    if key not in split:
        split[key] = sum(len(plan.stage(config, s).layers) for s in set(traced_stage_for(config, plan)))
    return min(plan.microbatches, COST_MICROBATCHES) * split[key]


def check_work(config: ModelConfig, work: Work, dtype: str, hws: list[HardwareConfig]) -> None:
    for name in ("gpus", "global_batch", "seq", "gpus_per_node"):
        if getattr(work, name) < 1:
            raise UserError(f"--{name} must be at least 1, got {getattr(work, name)}")
    if work.gpus > work.gpus_per_node and work.gpus % work.gpus_per_node:
        raise UserError(f"--gpus {work.gpus} is not a whole number of {work.gpus_per_node}-GPU nodes; give a "
                        f"multiple of {work.gpus_per_node} (or --gpus_per_node)")
    if work.seq > config.n_positions:
        raise UserError(f"--seq {work.seq} must be in 1..{config.n_positions} ({config.name}'s context)")
    if dtype == "fp8":
        for hw in hws:
            check_fp8(hw)


def no_feasible(config: ModelConfig, work: Work, enumerated: int, pruned: dict, smallest: int | None) -> str:
    """One line: how many layouts each rule pruned, and which rule took the last ones and what to change."""
    counts = {rule: max(n.values(), default=0) if isinstance(n, dict) else n for rule, n in pruned.items()}
    last = [rule for rule in RULES if counts.get(rule)]
    text = ", ".join(f"{counts[rule]} failed '{RULES[rule]}'" for rule in last)
    where = f"{config.name} on {work.gpus} GPUs, {work.global_batch} x {work.seq} tokens"
    if not last:
        return f"no layout of {where} to search; widen the constraints"
    why = ""
    if last[-1] == "memory" and smallest is not None:
        why = f" (the smallest needs {smallest / GB:.1f} GB per rank)"
    return (f"no feasible layout of {where}: of {enumerated} layouts, {text}; the last fell to "
            f"'{RULES[last[-1]]}'{why}: {ADVICE[last[-1]]}")


def layout_fields(config: ModelConfig, plan: TrainPlan) -> dict:
    return {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "cp": plan.cp, "ep": plan.ep, "etp": plan.etp,
            "vp": plan.virtual_stages, "sp": plan.sp, "zero": plan.zero, "recompute": plan.recompute, "mbs": plan.micro_batch_size,
            "microbatches": plan.microbatches, "layers": layers_text(config, plan), "name": layout_name(plan)}


def layout_name(plan: TrainPlan) -> str:
    """"TP8 PP16 DP128 mbs1 ZeRO1 SP sel" (degrees of 1 and defaults left out, but TP, PP and DP always)."""
    parts = [f"TP{plan.tp}", f"PP{plan.pp}" + (f"v{plan.virtual_stages}" if plan.virtual_stages > 1 else ""),
             f"DP{plan.dp}"]
    parts += [f"CP{plan.cp}"] * (plan.cp > 1) + [f"EP{plan.ep}"] * (plan.ep > 1)
    parts += [f"ETP{plan.etp}"] * (plan.etp != plan.tp)
    parts += [f"mbs{plan.micro_batch_size}", "FSDP" if plan.zero == 3 else f"ZeRO{plan.zero}"]
    parts += ["SP"] * plan.sp + [{"none": "", "selective": "sel", "full": "full"}[plan.recompute]]
    return " ".join(p for p in parts if p)


def make_row(config, work: Work, plan: TrainPlan, hw: HardwareConfig, peak: int, summary: dict, index: int) -> dict:
    step = summary["step_s"]
    return {"hw": hw.name, **layout_fields(config, plan), "step_s": step,
            "tokens_per_s_per_gpu": work.global_batch * work.seq / step / work.gpus, "mfu": summary.get("mfu"),
            "memory_gb": peak / GB, "bubble_fraction": summary["bubble_fraction"],
            "exposed_comm_s": summary["exposed_comm_s"], "index": index, "plan": dataclasses.asdict(plan)}


class _progress:
    """advance(n) over a rich progress bar when asked, else nothing."""

    def __init__(self, show: bool, total: int):
        self.show, self.total = show, total

    def __enter__(self):
        if not self.show:
            return lambda n: None
        from rich.progress import Progress
        from syntorch.console import console

        self.bar = Progress(console=console(), transient=True)
        self.bar.start()
        task = self.bar.add_task(f"predicting {self.total} layouts", total=self.total)
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc):
        if self.show:
            self.bar.stop()
