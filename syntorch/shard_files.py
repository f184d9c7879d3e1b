"""Per-rank checkpoints: `syntorch shard` cuts a HuggingFace folder into one safetensors file per rank, and a
rank of `syntorch infer` loads only its own weights (from its file, or its slices of a HuggingFace folder).

Which part of which tensor a rank holds comes from the plans, never from one family's names:
- the pipeline plan (parallel/pipeline.py): stage s owns the layers stage_layers gives it, the first stage the
  embeddings, the last the head; split_stage on a meta model says which tensors remain;
- the TP plan (parallel/tensor.py): a tensor of a module with a style is cut as take_shard cuts it (columns,
  rows, q/k/v by heads, vocabulary rows padded to Megatron's multiple); every other tensor (LayerNorms,
  row-parallel biases) is copied whole.
A family that gets a TP plan and stage layers therefore shards with no change here. Reads go through
checkpoints.LazyTensor (safetensors' get_slice), so neither the writer nor a rank holds more than one rank's
tensors, plus the one tensor in flight.

Ranks are numbered as parallel/mesh.py does (TP innermost): Mesh(pp=.., tp=..).rank_of(pp=stage, tp=tp_rank).
"""
import json
import os
from pathlib import Path

import torch
import torch.nn as nn

from syntorch.checkpoints import (RANK_KEY, SHARD_INDEX, ShardIndex, check_shard_layout, lazy_checkpoint,
                                  rank_file, read_shard_index)
from syntorch.config import ModelConfig
from syntorch.errors import UserError
from syntorch.models import build_model
from syntorch.outdir import atomic_output_dir
from syntorch.parallel.assemble import RankPlan, assemble_rank
from syntorch.parallel.mesh import Mesh, MeshGroups
from syntorch.parallel.pipeline import Stage, split_stage, stage_layers
from syntorch.parallel.tensor import TPPlan, check_tp, padded_vocab, plan_for, take_shard


def rank_file_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def stages(config: ModelConfig, pp: int) -> list[Stage]:
    return [Stage(s, pp, layers) for s, layers in enumerate(stage_layers(config.n_layer, pp))]


def stage_model(config: ModelConfig, stage: Stage | None, dtype=torch.float32) -> nn.Module:
    """The model on meta with only what `stage` owns (the whole model without a stage)."""
    model = build_model(config, device="meta", dtype=dtype)
    return model if stage is None or stage.count == 1 else split_stage(model, stage)


def unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with each tensor once (a tied head is stored as the embedding)."""
    seen, out = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _aliases(model: nn.Module) -> dict[str, str]:
    """Parameter name -> the name unique_state keeps for the same tensor (the tied head -> the embedding)."""
    first, out = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def rank_tensors(names, full: dict, styles: dict[str, str], tp_rank: int, tp: int,
                 config: ModelConfig) -> dict[str, torch.Tensor]:
    """This TP rank's part of each named tensor: cut by its module's style, whole without one."""
    vocab_pad = padded_vocab(config.vocab_size, tp)
    out = {}
    for name in names:
        module, _, param = name.rpartition(".")
        style = styles.get(module, "replicated")
        out[name] = take_shard(style, param, full[name], tp_rank, tp, vocab_pad, config.d_head, config.kv_heads).contiguous()
    return out


def write_shards(checkpoint, out_dir, tp: int, pp: int, force: bool = False) -> ShardIndex:
    """`syntorch shard`: one safetensors file per rank plus SHARD_INDEX, written into a folder that appears
    whole or not at all. Tensors keep the checkpoint's dtype; a run casts them to its --dtype."""
    if (Path(checkpoint) / SHARD_INDEX).is_file():
        raise UserError(f"{checkpoint} is already a sharded folder; give the HuggingFace folder it was made from")
    config, full = lazy_checkpoint(checkpoint, dtype=None)
    return write_state_shards(config, full, out_dir, tp, pp, force)


def write_state_shards(config: ModelConfig, full: dict, out_dir, tp: int, pp: int, force: bool = False,
                       flag: str = "--out", tokenizer=None) -> ShardIndex:
    """`full` (name -> whole tensor, or a lazy one) cut into one file per TP x PP rank and SHARD_INDEX, with
    `tokenizer.save(folder)`'s files when given (`syntorch train --save_format sharded`)."""
    from safetensors.torch import save_file

    check_tp(config, tp)
    files, tensors, layers = {}, {}, {}
    with atomic_output_dir(out_dir, force, flag) as tmp:
        for stage in stages(config, pp):
            model = stage_model(config, stage)
            styles = plan_for(model, sequence_parallel=False) if tp > 1 else {}
            for tp_rank in range(tp):
                rank = Mesh(pp=pp, tp=tp).rank_of(pp=stage.index, tp=tp_rank)
                part = rank_tensors(unique_state(model), full, styles, tp_rank, tp, config)
                files[rank], tensors[rank] = rank_file_name(rank), sorted(part)
                layers[rank] = [stage.layers.start, stage.layers.stop]
                # the rank it was cut for, inside the file: a file swapped with or linked to another rank's shows it
                save_file(part, str(tmp / files[rank]), metadata={"format": "pt", RANK_KEY: str(rank)})
                del part
        index = ShardIndex(config, tp, pp, files, tensors, layers)
        (tmp / SHARD_INDEX).write_text(json.dumps(index.to_dict(), indent=1) + "\n")
        for name in files.values():  # safetensors writes 0600; give the files the index's mode (umask applied)
            os.chmod(tmp / name, (tmp / SHARD_INDEX).stat().st_mode & 0o777)
        if tokenizer is not None:
            tokenizer.save(tmp)
    return index


def merged_state(folder) -> tuple[ModelConfig, dict]:
    """(config, the whole model's state) from a shard folder: every rank's file put back together."""
    index = read_shard_index(folder)
    mesh = Mesh(pp=index.pp, tp=index.tp)
    parts = []
    for rank in sorted(index.files):
        getters = rank_file(folder, index, rank)
        parts.append((mesh.coordinate(rank).tp, {name: read() for name, read in getters.items()}))
    return index.config, whole_state(index.config, index.tp, parts)


def whole_state(config: ModelConfig, tp: int, parts: list, etp: int | None = None) -> dict:
    """The whole model's state from (tp_rank, state) parts of every stage: rank_tensors undone. Where each
    element of a TP rank's tensor came from is found by cutting a tensor of element numbers as the plan cut
    the weights (take_shard), so every style, and the padded vocabulary, is undone without an inverse of its
    own. `etp` 1: experts whole on every rank (`syntorch train --etp 1`)."""
    from syntorch.parallel.expert import is_expert_param

    meta = build_model(config, "meta")
    styles, shapes = plan_for(meta, sequence_parallel=False) if tp > 1 else {}, meta.state_dict()
    state = {}
    for tp_rank, part in parts:
        for name, shard in part.items():
            module, _, param = name.rpartition(".")
            style = "replicated" if etp == 1 and is_expert_param(name) else styles.get(module, "replicated")
            if style == "replicated":
                state.setdefault(name, shard)
                continue
            full = state.setdefault(name, torch.zeros(shapes[name].shape, dtype=shard.dtype))
            numbers = torch.arange(1, full.numel() + 1, dtype=torch.float64).view(full.shape)  # 0: vocab padding
            where = take_shard(style, param, numbers, tp_rank, tp, padded_vocab(config.vocab_size, tp), config.d_head,
                               config.kv_heads)
            kept = where > 0
            full.view(-1)[where[kept].long() - 1] = shard[kept]
    return state


def loaded(config: ModelConfig, state: dict, device="cpu") -> nn.Module:
    """A whole model on `device` holding `state`; only aliases (a tied head) may be left out of it."""
    model = build_model(config, device)
    unset = set(model.load_state_dict(state, strict=False).missing_keys) & set(unique_state(model))
    if unset:
        raise RuntimeError(f"the ranks' parts leave {sorted(unset)} unset")
    return model


def load_rank_model(config: ModelConfig, checkpoint, device, dtype, groups: MeshGroups | None = None,
                    plan: RankPlan | None = None) -> nn.Module:
    """The model one rank runs, reading only its own weights: assemble.assemble_rank under `plan` (default: an
    inference run over the mesh of `groups`, this rank's MeshGroups; None: one rank) builds it on meta, cut
    and sharded, then fills it from `checkpoint` (a shard folder: this rank's file; a HuggingFace folder:
    this rank's slices)."""
    groups = groups or MeshGroups(Mesh(), 0)
    plan = plan or RankPlan(tp=groups.mesh.tp, pp=groups.mesh.pp, mode="infer")
    weights = checkpoint_weights(checkpoint, device, dtype)
    return assemble_rank(config, plan, groups, device, dtype, weights=weights).model


def checkpoint_weights(checkpoint, device, dtype):
    """assemble_rank's `weights` from `checkpoint`: load_rank_weights into the rank's cut, sharded model."""
    return lambda model, tp_plan, stage: load_rank_weights(model, checkpoint, device, dtype, tp_plan, stage)


def load_rank_weights(model: nn.Module, checkpoint, device, dtype, plan: TPPlan | None = None,
                      stage: Stage | None = None) -> None:
    """Fill `model` (on meta, already cut and TP-sharded) with this rank's tensors, assigned in place."""
    config, names = model.config, unique_state(model)
    tp, tp_rank = (plan.tp, plan.rank) if plan else (1, 0)
    pp, stage_index = (stage.count, stage.index) if stage else (1, 0)
    index = check_shard_layout(checkpoint, tp, pp)
    if index is not None:
        getters = rank_file(checkpoint, index, Mesh(pp=pp, tp=tp).rank_of(pp=stage_index, tp=tp_rank))
        state = {n: _cast(getters[n](), device, dtype) for n in names if n in getters}
    else:
        _, full = lazy_checkpoint(checkpoint, device, dtype)
        state = rank_tensors(names, full, plan.styles if plan else {}, tp_rank, tp, config)
    _check_rank_state(state, names, checkpoint)
    aliases = _aliases(model)
    model.load_state_dict(state, strict=False, assign=True)
    for alias, kept in aliases.items():  # re-tie what assign replaced on one side only
        parent, _, leaf = alias.rpartition(".")
        setattr(model.get_submodule(parent), leaf, model.get_parameter(kept))
    unfilled = [n for n, t in model.state_dict().items() if t.is_meta]
    if unfilled:
        raise RuntimeError(f"tensors {unfilled} were left unloaded (on meta); the rank's names disagree with the model's")


def _cast(t: torch.Tensor, device, dtype) -> torch.Tensor:
    return t.to(device, dtype) if t.is_floating_point() else t.to(device)


def _check_rank_state(state: dict, expected: dict, checkpoint) -> None:
    missing = sorted(set(expected) - set(state))
    if missing:
        raise UserError(f"{checkpoint}: this rank's file lacks {missing[0]}; the folder was sharded for another "
                        "model or layout, re-run syntorch shard")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise UserError(f"{checkpoint}: {name} has shape {list(t.shape)} where this rank needs "
                            f"{list(expected[name].shape)}; re-run syntorch shard for this --tp/--pp")

