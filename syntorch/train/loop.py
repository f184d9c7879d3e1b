"""Pretraining of GPT-2 (causal LM) or BERT (masked LM) on SQuAD text on a parallel plan (DP by default;
TP, PP, SP, CP, EP, ZeRO/FSDP, recomputation, mixed precision: planned.py, parallel/plans.py), with an optional
profiler capture turned into Chakra traces at the end. One function per rank: `train_rank(opts)`; it runs
the same under `torchrun` and under `syntorch train --nproc N` (which spawns the ranks)."""
import contextlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from syntorch.capture.profile import Schedule, TraceFiles
from syntorch.errors import UserError
from syntorch.train import squad as D
from syntorch.train.planned import PlanSteps, assemble, mesh_mean, plan_of, world_size

FAMILIES = {"gpt2": "gpt", "bert": "bert"}  # command-line family -> ModelConfig.arch
DEFAULT_MODEL = {"gpt2": "gpt2", "bert": "bert-base-uncased"}
CHECKPOINTS = ("best_model", "last_model")  # the folders a run saves into --save-dir
TRACE_FLAG = "--trace-output-dir"


@dataclass
class TrainOptions:
    family: str  # "gpt2" | "bert"
    data: str
    model_name: str
    tokenizer: str | None = None
    model_config: str | None = None
    device: str = "cpu"
    batch_size: int = 4  # per DP replica (its TP/PP/CP ranks read the same rows) and accumulation step
    learning_rate: float = 5e-5
    num_epochs: int = 3
    max_seq_length: int | None = None  # None: min(512, the model's positions)
    gradient_accumulation_steps: int = 1
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    logging_steps: int = 10
    save_steps: int = 0  # 0: save only at the end
    eval_steps: int = 0  # 0: evaluate at the end of each epoch
    max_steps: int = 0  # 0: run all epochs
    eval_fraction: float = 0.1  # held out from --data for evaluation and the best checkpoint
    save_dir: str | None = None
    save_format: str = "hf"  # "sharded": one file per TP x PP rank (shard_files.py's folder)
    seed: int = 42
    bucket_cap_mb: float = 25.0  # the gradient buckets' size (parallel/buckets.py)
    tp: int = 1  # the plan (parallel/plans.py); dp is what tp * pp * cp leave of the ranks
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # the experts' own TP size; None: tp
    sp: bool = False
    zero: int = 0
    fsdp: bool = False  # --zero 3
    recompute: str = "none"
    dtype: str = "fp32"
    virtual_stages: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int = 1  # per batch of --batch-size rows
    tracing: bool = False
    trace_output_dir: str = "outputs"
    trace_name: str | None = None  # default: <family>_<world>rank
    force: bool = False  # replace an earlier run's traces in trace_output_dir
    schedule: Schedule = field(default_factory=Schedule)


def load_model(opts: TrainOptions, device):
    """(config, model): a local HuggingFace folder as from_pretrained reads it, or a registry name
    (random init), optionally overridden by --model_config."""
    from syntorch.checkpoints import SHARD_INDEX, load_checkpoint, resolve_model_config
    from syntorch.models import build_model
    from syntorch.shard_files import loaded, merged_state

    if (Path(opts.model_name) / SHARD_INDEX).is_file():
        config, state = merged_state(opts.model_name)
        model = loaded(config, state, device)
    elif Path(opts.model_name).is_dir():
        config, model = load_checkpoint(opts.model_name, device=device)
    else:
        config = resolve_model_config(opts.model_name, opts.model_config)
        model = build_model(config, device=device)
    if config.arch != FAMILIES[opts.family]:
        raise UserError(f"model '{opts.model_name}' is a {config.arch} model, not {opts.family}; "
                        f"use `syntorch train {'gpt2' if config.arch == 'gpt' else 'bert'}` or another --model-name")
    return config, model.train()


def tokenizer_dir(opts: TrainOptions) -> str:
    if opts.tokenizer:
        return opts.tokenizer
    if Path(opts.model_name).is_dir() and any((Path(opts.model_name) / f).is_file()
                                              for f in ("tokenizer.json", "vocab.txt", "vocab.json")):
        return opts.model_name
    raise UserError("give --tokenizer DIR (a local HuggingFace tokenizer folder); syntorch downloads nothing")


def sequence_length(opts: TrainOptions, config) -> int:
    length = min(512, config.n_positions) if opts.max_seq_length is None else opts.max_seq_length
    if not 4 <= length <= config.n_positions:
        raise UserError(f"--max-seq-length {length} must be in 4..{config.n_positions} (the model's positions)")
    return length


def build_datasets(opts: TrainOptions, config, tokenizer, replica: int):
    """(train items, eval items, collate) for the family's objective; `replica` seeds BERT's masks."""
    if len(tokenizer) > config.vocab_size:
        raise UserError(f"tokenizer has {len(tokenizer)} tokens but model '{config.name}' only {config.vocab_size}; "
                        "give a matching --tokenizer or a larger vocab_size in --model_config")
    pairs = D.load_squad(opts.data)
    length, ids = sequence_length(opts, config), D.special_ids(tokenizer, opts.family)
    if opts.family == "gpt2":
        # one token more than the model reads: its last position's target (planned.py)
        items, collate = D.encode_causal(pairs, tokenizer, length + 1, ids["eos"]), D.CausalCollate(ids["pad"])
    else:
        items = D.encode_masked(pairs, tokenizer, length, ids)
        collate = D.MaskedCollate(ids, len(tokenizer), opts.seed + replica)
    n_eval = int(len(items) * opts.eval_fraction) if len(items) > 1 else 0
    return items[:len(items) - n_eval], items[len(items) - n_eval:], collate


def lr_schedule(optimizer, opts: TrainOptions, total_steps: int):
    """Linear warmup then linear decay to 0, on the plan's AdamW."""

    def factor(step):
        if step < opts.warmup_steps:
            return (step + 1) / opts.warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - opts.warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def join_ranks(device: str) -> tuple[int, int, torch.device]:
    """(rank, world, this rank's device): the torchrun environment's process group, or a lone process."""
    from syntorch.parallel.launch import check_devices, init_distributed, under_torchrun

    distributed = under_torchrun() and int(os.environ["WORLD_SIZE"]) > 1
    check_devices(device, int(os.environ["WORLD_SIZE"]) if distributed else 1)
    rank, world = init_distributed(device) if distributed else (0, 1)
    if torch.device(device).type == "cuda":
        return rank, world, torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return rank, world, torch.device(device)


class Trainer:
    """The loop over optimizer steps: gradient accumulation, evaluation, checkpoints, progress. The steps
    themselves (schedule, gradient sync, clipping, update) are the plan's (PlanSteps)."""

    def __init__(self, opts: TrainOptions, rank: int, world: int, device, run, tokenizer):
        self.opts, self.rank, self.world, self.device = opts, rank, world, device
        self.steps, self.tokenizer = PlanSteps(opts, run, device), tokenizer
        # every rank of a DP replica reads the replica's rows; the BERT masks are the replica's too
        replica, replicas = run.plan.mesh.coordinate(rank).dp, run.plan.dp
        train_items, eval_items, collate = build_datasets(opts, run.model.config, tokenizer, replica)
        self.sampler = DistributedSampler(train_items, num_replicas=replicas, rank=replica, shuffle=True,
                                          seed=opts.seed)
        # whole batches only: the plan's micro-batches have one size
        self.loader = DataLoader(train_items, batch_size=opts.batch_size, sampler=self.sampler, collate_fn=collate,
                                 drop_last=True)
        eval_sampler = DistributedSampler(eval_items, num_replicas=replicas, rank=replica, shuffle=False) \
            if eval_items else None
        self.eval_loader = DataLoader(eval_items, batch_size=opts.batch_size, sampler=eval_sampler,
                                      collate_fn=collate, drop_last=True)
        self.total = self._count_steps(len(train_items))
        self.scheduler = lr_schedule(run.optimizer, opts, self.total)
        self.history, self.best = [], math.inf

    def _count_steps(self, n_items: int) -> int:
        opts = self.opts
        total = len(self.loader) // opts.gradient_accumulation_steps * opts.num_epochs
        total = min(total, opts.max_steps) if opts.max_steps else total
        if total < 1:
            raise UserError(f"{n_items} training sequences make no optimizer step with batch size {opts.batch_size} x "
                            f"{self.steps.run.plan.dp} replicas x {opts.gradient_accumulation_steps} accumulation "
                            "steps; give more data")
        if opts.tracing and total < opts.schedule.steps:
            raise UserError(f"--enable-tracing needs {opts.schedule.steps} optimizer steps (wait + warmup + active) "
                            f"but this run has {total}; give more data or epochs, or fewer trace steps")
        return total

    def micro_batches(self):
        """(epoch, batch, last micro-batch of its optimizer step) until the step budget is spent."""
        accum, steps = self.opts.gradient_accumulation_steps, 0
        for epoch in range(self.opts.num_epochs):
            self.sampler.set_epoch(epoch)
            usable = len(self.loader) // accum * accum  # a trailing partial accumulation is skipped
            for i, batch in enumerate(self.loader):
                if i >= usable or steps == self.total:
                    break
                last = (i + 1) % accum == 0
                steps += last
                yield epoch, batch, last

    def fit(self, profiler=None) -> None:
        """Trains `total` optimizer steps; `profiler.step()` after each. Evaluation and checkpoints wait
        until the profiler's window is over, so the trace holds training steps only."""
        opts, step, losses, pending, epoch_seen = self.opts, 0, [], [], 0
        with progress_bar(self.rank == 0, self.total, opts.family) as advance:
            for epoch, batch, last in self.micro_batches():
                if epoch != epoch_seen and not opts.eval_steps and not self._recording(profiler, step):
                    self.evaluate_and_keep(step)
                epoch_seen = epoch
                pending.append(batch)
                if not last:
                    continue
                losses.append(self.steps.step(pending))
                self.scheduler.step()
                pending, step = [], step + 1
                if profiler is not None:
                    profiler.step()
                if step % opts.logging_steps == 0 or step == self.total:
                    # the losses live on the last stages: one all-reduce per logged step, not per step
                    loss = sum(mesh_mean(self.steps.run, losses, self.device)) / len(losses)
                    self.history.append({"step": step, "epoch": epoch, "loss": loss,
                                         "lr": self.scheduler.get_last_lr()[0]})
                    losses = []
                advance(self.history[-1]["loss"] if self.history and "loss" in self.history[-1] else math.nan)
                if not self._recording(profiler, step):
                    self.periodic(step)
        self.evaluate_and_keep(step)
        self.save("last_model")

    def _recording(self, profiler, step: int) -> bool:
        return profiler is not None and step < self.opts.schedule.steps

    def periodic(self, step: int) -> None:
        if self.opts.eval_steps and step % self.opts.eval_steps == 0 and step < self.total:
            self.evaluate_and_keep(step)
        if self.opts.save_steps and step % self.opts.save_steps == 0 and step < self.total:
            self.save("last_model")

    def evaluate_and_keep(self, step: int) -> None:
        """Held-out loss (train loss when nothing is held out); the best so far is saved as best_model."""
        loss = self.steps.evaluate(self.eval_loader)
        if loss is None:
            loss = next((h["loss"] for h in reversed(self.history) if "loss" in h), math.inf)
        self.history.append({"step": step, "eval_loss": loss})
        if loss < self.best:
            self.best = loss
            self.save("best_model")

    def save(self, kind: str) -> None:
        if self.opts.save_dir:  # the tokenizer too, so `--model-name <save-dir>/<kind>` finds it
            self.steps.save(Path(self.opts.save_dir) / kind, self.tokenizer, self.rank)

    def summary(self) -> dict:
        train = [h["loss"] for h in self.history if "loss" in h]
        evals = [h["eval_loss"] for h in self.history if "eval_loss" in h]
        return {"steps": self.total, "world": self.world, "first_loss": train[0], "last_loss": train[-1],
                "best_eval_loss": self.best, "last_eval_loss": evals[-1], "history": self.history,
                "save_dir": self.opts.save_dir}


@contextlib.contextmanager
def progress_bar(show: bool, total: int, family: str):
    """A rich progress bar with the running loss on rank 0; a no-op elsewhere."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn(f"[bold]{family}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.4f}"), TimeRemainingColumn())
    with Progress(*columns, disable=not show) as progress:
        task = progress.add_task("train", total=total, loss=math.nan)
        yield lambda loss: progress.update(task, advance=1, loss=loss)


def capture(trainer: Trainer, opts: TrainOptions) -> dict:
    """Trains under the profiler, then links and converts this rank's traces. Every rank's files appear
    in --trace-output-dir together, after all ranks converted theirs."""
    from syntorch.capture.to_chakra import convert_rank, write_comm_groups
    from syntorch.capture.flight_recorder import CollectiveLog
    from syntorch.capture.peers import find_peers, read_ranks
    from syntorch.capture.profile import make_profiler

    name, log = opts.trace_name or f"{opts.family}_{trainer.world}rank", CollectiveLog()
    with trace_folder(opts, trainer.rank, trainer.world) as tmp:
        files = TraceFiles(tmp, name, trainer.rank)
        with make_profiler(files, opts.schedule, opts.device, log) as profiler:
            trainer.fit(profiler)
        if trainer.world > 1:  # every rank's traces are written: sends and recvs find their peers across them
            dist.barrier()
        ops, groups = read_ranks([(TraceFiles(tmp, name, r).host, TraceFiles(tmp, name, r).device)
                                  for r in range(trainer.world)])
        result = convert_rank(files.host, files.device, trainer.rank, files.et, files.merged,
                              collectives=log.collectives,
                              peers=find_peers(ops, groups)[trainer.rank])
        if trainer.rank == 0:  # each rank's profiler lists the groups it is in
            write_comm_groups({k: v for g in groups.values() for k, v in g.items()}, tmp / "comm_groups.json")
    prefix = Path(opts.trace_output_dir) / name
    return {**{k: result[k] for k in ("nodes", "collectives", "comm_bytes", "repairs", "notes")}, "prefix": str(prefix)}


@contextlib.contextmanager
def trace_folder(opts: TrainOptions, rank: int, world: int):
    """--trace-output-dir's temporary folder, one for all ranks: rank 0 owns it (syntorch.outdir's policy),
    every rank writes its files into it, and rank 0 moves them into place once every rank is done."""
    from syntorch.outdir import atomic_output_dir

    owner = atomic_output_dir(opts.trace_output_dir, opts.force, TRACE_FLAG) if rank == 0 else contextlib.nullcontext()
    with owner as tmp:
        where = [str(tmp)]
        if world > 1:
            dist.broadcast_object_list(where, src=0)
        yield Path(where[0])
        if world > 1:
            dist.barrier()


def train_rank(opts: TrainOptions) -> dict:
    """Train on this rank (and capture, with opts.tracing). Rank 0 writes train_log.json into --save-dir
    and prints the summary; every rank returns it."""
    if opts.tracing:  # before the process group starts: which group each collective used (capture/flight_recorder.py)
        from syntorch.capture.flight_recorder import enable
        enable()
    rank, world, device = join_ranks(opts.device)
    torch.manual_seed(opts.seed)  # the same initial weights on every rank, which the plan then cuts
    config, model = load_model(opts, device)
    plan = plan_of(opts, world, sequence_length(opts, config))
    plan.check(config, world)
    tokenizer = D.LocalTokenizer(tokenizer_dir(opts))
    trainer = Trainer(opts, rank, world, device, assemble(opts, plan, config, model, device), tokenizer)
    if opts.tracing:
        trace = capture(trainer, opts)
    else:
        trainer.fit()
        trace = None
    summary = {**trainer.summary(), "trace": trace}
    if rank == 0:
        report(summary, opts)
    return summary


def report(summary: dict, opts: TrainOptions) -> None:
    from syntorch.console import console as make_console
    from syntorch.outdir import atomic_output_file

    if opts.save_dir:
        with atomic_output_file(Path(opts.save_dir) / "train_log.json", "--save-dir", named=False) as out:
            Path(out).write_text(json.dumps(summary["history"], indent=1) + "\n")
    console = make_console()
    logged = sum(1 for h in summary["history"] if "loss" in h)
    loss = (f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} over {logged} logged steps" if logged > 1
            else f"loss {summary['last_loss']:.4f} (one logged step)")
    console.print(f"{opts.family}: {summary['steps']} steps on {summary['world']} rank(s), {loss}, "
                  f"best eval loss {summary['best_eval_loss']:.4f}")
    if opts.save_dir:
        console.print(f"checkpoints: {Path(opts.save_dir) / 'best_model'}, {Path(opts.save_dir) / 'last_model'}")
    if summary["trace"]:
        t = summary["trace"]
        console.print(f"Chakra traces: {t['prefix']}.<rank>.et ({t['nodes']} nodes, {t['collectives']} collectives "
                      f"of {t['comm_bytes']} B on rank 0)")
        for note in t["notes"] + t["repairs"]:
            console.print(f"  note: {note}")


def preflight(opts: TrainOptions, world: int) -> None:
    """Checks the inputs before ranks are spawned, so a user's mistake is one line, not a rank failure."""
    from syntorch.checkpoints import SHARD_INDEX, checkpoint_config, read_shard_index, resolve_model_config

    D.load_squad(opts.data)
    D.LocalTokenizer(tokenizer_dir(opts))
    if (Path(opts.model_name) / SHARD_INDEX).is_file():
        config = read_shard_index(opts.model_name).config
    elif Path(opts.model_name).is_dir():
        config = checkpoint_config(opts.model_name)
    else:
        config = resolve_model_config(opts.model_name, opts.model_config)
    plan_of(opts, world, sequence_length(opts, config)).check(config, world)
    check_outputs(opts)


def check_outputs(opts: TrainOptions) -> None:
    """The output folders, by syntorch.outdir's policy, before any training: a refusal is one line, not a
    lost run. Checkpoints replace earlier ones (see save_checkpoint); traces need --force to."""
    from syntorch.outdir import check_output_dir, check_output_file

    if opts.tracing:
        prefix = opts.trace_name or f"{opts.family}_1rank"  # any rank count: numbered names are one family
        check_output_dir(opts.trace_output_dir, opts.force, TRACE_FLAG, new_files=["comm_groups.json", f"{prefix}.0.et"])
        if opts.save_dir and Path(opts.save_dir).resolve().is_relative_to(Path(opts.trace_output_dir).resolve()):
            raise UserError(f"--save-dir {opts.save_dir} is inside {TRACE_FLAG} {opts.trace_output_dir}, "
                            "which holds the traces only; give them separate folders")
    for kind in CHECKPOINTS if opts.save_dir else ():
        check_output_dir(Path(opts.save_dir) / kind, True, "--save-dir")
    if opts.save_dir:  # a train_log.json of the user's there is not ours to replace
        check_output_file(Path(opts.save_dir) / "train_log.json", "--save-dir", named=False)


def launch(opts: TrainOptions, nproc: int | None) -> None:
    """Train on `nproc` spawned ranks, or on the ranks torchrun started."""
    from syntorch.parallel.launch import RankFailed, spawn, under_torchrun

    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if nproc not in (None, world):
            raise UserError(f"--nproc {nproc} but torchrun started {world} ranks; drop --nproc under torchrun")
        preflight(opts, world)
        train_rank(opts)
        return
    preflight(opts, world_size(nproc))
    if opts.tracing:
        from syntorch.capture.profile import quiet_profiler
        quiet_profiler()  # before the ranks start and import torch
    if (nproc or 1) == 1:
        train_rank(opts)
        return
    try:
        spawn(train_rank, nproc, (opts,))
    except RankFailed as e:
        cause = str(e)
        if ": UserError: " in cause:  # a user's mistake found inside a rank: one line, exit 2
            raise UserError(cause.replace("UserError: ", "")) from None
        raise
