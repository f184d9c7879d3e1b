"""`syntorch train` on the parallel plans (parallel/plans.py): the mesh from the options, this rank's run,
its micro-batches of SQuAD batches, the step and evaluation losses over the mesh, and checkpoints.

One rank of a DP replica takes the replica's batch (every TP/PP/CP rank of it reads the same rows); a batch of
--batch-size rows is cut into --microbatches micro-batches, and --gradient-accumulation-steps batches make one
optimizer step. With PP, CP or SP sequences have a fixed length (the pipeline's messages and the splits need
one): GPT-2 reads --max-seq-length tokens and predicts the next --max-seq-length (items are cut and padded to
one more token), BERT reads and predicts --max-seq-length positions; other plans pad to the batch's longest."""
import os
from pathlib import Path

import torch
import torch.distributed as dist

from syntorch.errors import UserError
from syntorch.train import squad as D


def plan_of(opts, world: int, seq: int):
    """The TrainPlan of the options on `world` ranks for `seq`-token sequences: dp is what the mesh leaves."""
    from syntorch.parallel.plans import TrainPlan

    model_parallel = opts.tp * opts.pp * opts.cp
    if world % model_parallel:
        raise UserError(f"tp({opts.tp}) * pp({opts.pp}) * cp({opts.cp}) = {model_parallel} does not divide the "
                        f"{world} ranks (--nproc, or torchrun's); the plan's mesh is dp * tp * pp * cp ranks")
    if opts.ep > 1 and opts.tp > 1 and (opts.etp or opts.tp) > 1:
        # checkpoints gather each EP rank's experts whole; TP-sharded experts would need an un-shard over ETP too
        raise UserError(f"train with --ep {opts.ep} and --tp {opts.tp} keeps each expert whole on a rank: add --etp 1 "
                        "(syntorch trace takes any --etp)")
    if opts.batch_size % opts.microbatches:
        raise UserError(f"--microbatches {opts.microbatches} must divide --batch-size {opts.batch_size}")
    return TrainPlan(dp=world // model_parallel, tp=opts.tp, pp=opts.pp, cp=opts.cp, ep=opts.ep, etp=opts.etp,
                     sp=opts.sp, zero=3 if opts.fsdp else opts.zero, bucket_mb=opts.bucket_cap_mb, schedule=opts.pp_schedule,
                     microbatches=opts.microbatches * opts.gradient_accumulation_steps,
                     micro_batch_size=opts.batch_size // opts.microbatches, seq=seq, lr=opts.learning_rate,
                     recompute=opts.recompute, virtual_stages=opts.virtual_stages, clip_grad=opts.max_grad_norm)


def assemble(opts, plan, config, model, device):
    """This rank's StageRun of the whole `model` (loaded on `device`) and its mesh groups."""
    from syntorch.config import torch_dtype
    from syntorch.parallel.mesh import MeshGroups, init_groups
    from syntorch.parallel.plans import apply_plans

    groups = init_groups(plan.mesh, config.tied_head) if dist.is_initialized() else MeshGroups(plan.mesh, 0)
    dtype = torch_dtype(opts.dtype)
    run = apply_plans(config, plan, groups, device, dtype, model.to(dtype))
    for group in run.optimizer.param_groups:  # flat ZeRO/FSDP shards cannot tell biases from matrices
        group["weight_decay"] = opts.weight_decay
    return run


def fixed(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """[B, T] cut or padded with `value` to [B, width]."""
    return torch.nn.functional.pad(t[:, :width], (0, max(0, width - t.shape[1])), value=value)


def micro_batches(batches: list, plan, family: str, device) -> list:
    """train_step's micro-batches of loader batches: (tokens, targets[, the model's other inputs])."""
    out, size = [], plan.micro_batch_size
    for batch in batches:
        b = batch.to(device)
        # the pipeline's messages and CP's and SP's splits need the plan's length; else the batch's longest will do
        seq = plan.seq if plan.pp > 1 or plan.cp > 1 or plan.sp else b.tokens.shape[1] - (family == "gpt2")
        for i in range(0, b.tokens.shape[0], size):
            rows = slice(i, i + size)
            if family == "gpt2":  # the seed's loss: logits[:, :-1] against labels[:, 1:]
                out.append((fixed(b.tokens[rows], seq + 1, 0)[:, :-1], fixed(b.labels[rows], seq + 1, D.IGNORE)[:, 1:]))
            else:
                out.append((fixed(b.tokens[rows], seq, 0), fixed(b.labels[rows], seq, D.IGNORE),
                            {"token_type_ids": fixed(b.token_types[rows], seq, 0),
                             "attention_mask": fixed(b.attention_mask[rows], seq, 0)}))
    return out


def mesh_mean(run, losses: list, device) -> list[float]:
    """The global means of per-step losses: each is held by the last stage's ranks of every DP x CP replica
    (every TP rank of it has the whole value: the first gives it)."""
    held = run.stage.last and run.groups.tp_rank == 0
    values = torch.tensor([float(v) if held else 0.0 for v in losses], device=device, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(values)
    return (values / run.plan.grad_ranks).tolist()


class PlanSteps:
    """The Trainer's steps on the plans: one optimizer step, an evaluation, a checkpoint."""

    def __init__(self, opts, run, device):
        self.opts, self.run, self.device = opts, run, device

    def step(self, batches: list):
        from syntorch.parallel.plans import train_step

        # train_step accumulates into .grad (one step is what it models): the last step's gradients go first,
        # the model's and those of what the optimizer updates (ZeRO/FSDP shards, FP32 masters)
        self.run.model.zero_grad(set_to_none=True)
        self.run.optimizer.zero_grad(set_to_none=True)
        # the step's phases as the symbolic trace names them (Tracer.phase), as ranges in a profiler capture
        loss = train_step(self.run, micro_batches(batches, self.run.plan, self.opts.family, self.device),
                          torch.profiler.record_function)
        return loss.detach() if loss is not None else 0.0

    def evaluate(self, loader) -> float | None:
        """Mean loss over every replica's held-out batches (None without any)."""
        from syntorch.parallel.plans import eval_step

        self.run.model.eval()
        losses = [eval_step(self.run, micro_batches([b], self.run.plan, self.opts.family, self.device))
                  for b in loader]
        self.run.model.train()
        losses = [0.0 if loss is None else loss for loss in losses]  # None off the last stage
        return sum(mesh_mean(self.run, losses, self.device)) / len(losses) if losses else None

    def save(self, folder: Path, tokenizer, rank: int) -> None:
        """From rank 0, one HuggingFace folder (--save-format hf) or one file per TP x PP rank of the plan
        (sharded, shard.py's folder): its own model under pure DP/ZeRO/FSDP, else the whole model put together
        from the first replica's TP/PP ranks (and EP ranks' experts)."""
        from syntorch.checkpoints import save_checkpoint
        from syntorch.shard_files import loaded, unique_state, write_state_shards

        full = getattr(self.run.grad_sync, "full_parameters", None)
        if full is not None:  # FSDP: every rank takes part in the all-gather
            full()
        plan, model = self.run.plan, self.run.model
        if plan.tp > 1 or plan.pp > 1 or plan.ep > 1:
            state = self._from_model_parallel_ranks(rank) if plan.tp > 1 or plan.pp > 1 else model.state_dict()
            state = self._with_every_expert(state) if plan.ep > 1 else state
            model = loaded(model.config, state) if rank == 0 else None
        if rank != 0:
            return
        if self.opts.save_format == "sharded":
            state = {n: t.detach().cpu() for n, t in unique_state(model).items()}
            write_state_shards(model.config, state, folder, plan.tp, plan.pp, True, "--save-dir", tokenizer)
        else:
            save_checkpoint(model, folder, tokenizer, "--save-dir")

    def _from_model_parallel_ranks(self, rank: int):
        """The whole model's state on rank 0 (None elsewhere) from the TP/PP ranks of DP x CP replica 0."""
        from syntorch.shard_files import unique_state, whole_state

        coordinate, groups = self.run.plan.mesh.coordinate(rank), self.run.groups
        mine = None
        if coordinate.dp == coordinate.cp == 0:
            mine = (groups.tp_rank, {n: t.detach().cpu() for n, t in unique_state(self.run.model).items()})
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        plan = self.run.plan
        return whole_state(self.run.model.config, plan.tp, [p for p in everyone if p], plan.etp) if rank == 0 else None

    def _with_every_expert(self, whole: dict | None) -> dict | None:
        """EP: the whole state on rank 0 (None elsewhere), each EP rank's experts under their global index."""
        from syntorch.parallel.expert import ExpertParallelMoE, is_expert_param

        mine = {f"{name}.experts.{moe.first_expert + i}.{key}": t.detach().cpu()
                for name, moe in self.run.model.named_modules() if isinstance(moe, ExpertParallelMoE)
                for i, expert in enumerate(moe.experts) for key, t in expert.state_dict().items()}
        everyone = [None] * self.run.plan.ep
        dist.all_gather_object(everyone, mine, group=self.run.groups.ep)
        if dist.get_rank() != 0:
            return None
        state = {k: t for k, t in whole.items() if not is_expert_param(k)}
        for part in everyone:
            state.update(part)
        return state


def world_size(nproc: int | None) -> int:
    """The ranks the run will have: torchrun's, or --nproc."""
    from syntorch.parallel.launch import under_torchrun

    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else (nproc or 1)
