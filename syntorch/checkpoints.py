"""HuggingFace checkpoints <-> syntorch models.

Loads GPT2LMHeadModel, GPTJForCausalLM, BertForMaskedLM, LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, MixtralForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM and GptOssForCausalLM (unquantized)
directories as they are (config.json + model.safetensors or pytorch_model.bin, optionally sharded with an
index.json) and saves our models so
`transformers`' `from_pretrained` reads them back with the same logits; also reads lazily (a rank's slices)
and `syntorch shard` folders. The format itself (families, config fields, tensor names) is hf_format.py.
"""
import json
import os
import pickle
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from syntorch.config import ModelConfig, config_from_dict, get_config, load_model_config
from syntorch.errors import UserError
from syntorch.hf_format import (check_shape, checked_key_map, few_names, hf_config_to_model_config,
                                 hf_to_syntorch_state_dict, model_config_to_hf_config, source_names,
                                 syntorch_to_hf_state_dict)
from syntorch.hf_stacked import Stacked, StackedView
from syntorch.userfiles import read_json
from syntorch.models import build_model
from syntorch.outdir import atomic_output_dir



def checked_weight(name: str, t: torch.Tensor, where) -> torch.Tensor:
    """A weight as read from a stranger's file: floating point and finite, else one line naming it."""
    if not t.is_floating_point():
        raise UserError(f"{where}: tensor {name} is {str(t.dtype).removeprefix('torch.')}, not floating point; "
                        "a model's weights must be floats: re-save the checkpoint")
    if t.device.type != "meta" and not torch.isfinite(t).all():
        raise UserError(f"{where}: tensor {name} holds NaN or infinity; the checkpoint is damaged: re-save it")
    return t


class _LazyTensors(Mapping):
    """name -> tensor, read from disk on access, checked and cast to (device, dtype), so no full second copy
    is held."""

    def __init__(self, getters: dict, device, dtype, where):
        self._getters, self._device, self._dtype, self._where = getters, device, dtype, where

    def __getitem__(self, key):
        return checked_weight(key, self._getters[key](), self._where).to(self._device, self._dtype)

    def __iter__(self):
        return iter(self._getters)

    def __len__(self):
        return len(self._getters)


def _weight_files(path: Path) -> list[Path]:
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (path / single).is_file():
            return [path / single]
        if (path / index).is_file():
            weight_map = _read_json(path / index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise UserError(f"{path / index} has no 'weight_map' object; re-save the checkpoint")
            names = list(dict.fromkeys(weight_map.values()))
            outside = [n for n in names if not isinstance(n, str) or Path(n).name != n or n in (".", "..")]
            if outside:  # a stranger's index must not make us read /etc/hostname
                raise UserError(f"{path / index} names {outside[0]!r}, not a file of {path}; an index names the "
                                "shard files beside it")
            files = [path / name for name in names]
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise UserError(f"{path / index} names shard(s) {few_names(absent)} that are not in {path}")
            return files
    raise UserError(f"no weights in {path}: expected model.safetensors or pytorch_model.bin (or a sharded index.json)")


def _file_rank(f: Path) -> str | None:
    """The rank `syntorch shard` wrote into a rank file's metadata (None in files of earlier versions)."""
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as handle:
        return (handle.metadata() or {}).get(RANK_KEY)


def _open_weights(files: list[Path], slices: bool = False) -> dict:
    """name -> zero-argument function that reads that tensor (with `slices`: an object read only where indexed,
    safetensors' get_slice, or the memory-mapped tensor of a .bin)."""
    getters = {}
    for f in files:
        try:
            getters.update(_open_safetensors(f, slices) if f.suffix == ".safetensors" else _open_bin(f, slices))
        except UserError:
            raise
        except pickle.UnpicklingError as e:
            if "Weights only load failed" not in str(e):
                raise UserError(f"cannot read weights file {f} ({e}); it is corrupt or truncated") from None
            raise UserError(f"weights file {f} holds objects other than tensors (a pickle that could run code), "
                            "which syntorch never loads; save it as safetensors from a copy you trust") from None
        except Exception as e:  # any parse failure of a stranger's file: truncated, corrupt, not a state dict
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"cannot read weights file {f} ({first}); it is corrupt or truncated, re-download or "
                            "re-save it") from None
    return getters


def _open_safetensors(f: Path, slices: bool = False) -> dict:
    from safetensors import safe_open

    handle = safe_open(str(f), framework="pt")  # reads the header only; tensors are read on access
    return {k: handle.get_slice(k) if slices else (lambda k=k: handle.get_tensor(k)) for k in handle.keys()}


def _open_bin(f: Path, slices: bool = False) -> dict:
    # a pickle: only the restricted unpickler. mmap leaves the file's pages to the OS until they are used;
    # torch can map only the zip format (since torch 1.6), older files are read whole
    state = torch.load(f, weights_only=True, map_location="cpu", mmap=zipfile.is_zipfile(f))
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                              for k, t in state.items()):
        raise UserError(f"weights file {f} is not a state dict of named tensors; save it with save_pretrained")
    return {k: t if slices else (lambda t=t: t) for k, t in state.items()}


def _vocab_index(vocab: Path, token: str, default: int) -> int:
    """Line number of `token` in a WordPiece vocab.txt (saved beside BERT checkpoints), else `default`."""
    if not vocab.is_file():
        return default
    lines = vocab.read_text(encoding="utf-8", errors="replace").splitlines()
    return lines.index(token) if token in lines else default


def _read_json(path: Path) -> dict:
    value = read_json(path, "checkpoint file")
    if not isinstance(value, dict):
        raise UserError(f"{path} must hold a JSON object")
    return value


def checkpoint_config(path) -> ModelConfig:
    """The ModelConfig of a HuggingFace directory (its config.json), named after the folder."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"checkpoint folder not found: {path}")
    if (path / SHARD_INDEX).is_file():
        return read_shard_index(path).config
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json; give a HuggingFace model folder (config.json + weights)")
    hf_config = _read_json(path / "config.json")
    config = hf_config_to_model_config(hf_config, name=path.resolve().name)
    if config.arch == "bert" and "mask_token_id" not in hf_config:
        config.mask_token_id = _vocab_index(path / "vocab.txt", "[MASK]", default=config.mask_token_id)
    return config


def resolve_model_config(model: str, model_config: str | None = None, checkpoint: str | None = None) -> ModelConfig:
    """The one way every command finds its model: a checkpoint folder's config.json, else a --model_config
    file (overriding the registry model `model`, or defining one), else the registry model."""
    if checkpoint:
        return checkpoint_config(checkpoint)
    if model_config:
        return load_model_config(model_config, base_name=model)
    return get_config(model)


def read_checkpoint(path, device="cpu", dtype=torch.float32) -> tuple[ModelConfig, dict]:
    """(ModelConfig, our full state dict) from a HuggingFace directory; tensors are read one at a time."""
    config = checkpoint_config(path)
    path = Path(path)
    hf_state = _LazyTensors(_open_weights(_weight_files(path)), device, dtype, path)
    return config, hf_to_syntorch_state_dict(hf_state, config)


def load_checkpoint(path, device="cpu", dtype=torch.float32):
    """(ModelConfig, model) from a HuggingFace directory. Builds on meta and assigns the loaded tensors,
    so the weights are allocated once."""
    config, state = read_checkpoint(path, device, dtype)
    model = build_model(config, device="meta", dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return config, model.eval()


def save_checkpoint(model, path, tokenizer=None, flag: str = "checkpoint folder") -> None:
    """Write `model` as a HuggingFace folder (config.json + model.safetensors) that from_pretrained loads, with
    `tokenizer.save(folder)`'s files when given. It replaces a checkpoint syntorch saved there (a run saves
    best_model many times) but, by syntorch.outdir's policy, never a folder holding anything else."""
    from safetensors.torch import save_file

    if any(p.is_meta for p in model.parameters()):
        raise UserError("cannot save a model on the meta device: it has no weights")
    hf_config = model_config_to_hf_config(model.config)
    tensors = syntorch_to_hf_state_dict(model)
    with atomic_output_dir(path, force=True, flag=flag) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # safetensors writes its file 0600; give it the mode the folder's other files got (umask applied)
        os.chmod(tmp / "model.safetensors", (tmp / "config.json").stat().st_mode & 0o777)
        if tokenizer is not None:
            tokenizer.save(tmp)


# ---- per-rank reads: our tensors sliced lazily from a HuggingFace folder, and `syntorch shard` folders


class LazyTensor:
    """One of our full tensors, in our layout, read from a HuggingFace folder only where indexed: `t[a:b]`
    reads rows a..b, `t[:, a:b]` columns, `t[:]` everything, through safetensors' get_slice, so a TP rank
    reads the bytes of its own slice (parallel/tensor.py's take_shard indexes it like a tensor).

    `parts`: the HF tensors stacked along dim 0 into ours (GPT-J's q, k, v); `transposed`: HF stores them
    [in, out] (GPT-2's Conv1D); floating tensors are read as (device, dtype), dtype None keeping the stored one."""

    def __init__(self, parts: list, transposed: bool, device, dtype, name: str = "", where=""):
        self._parts, self._transposed, self._device, self._dtype = parts, transposed, device, dtype
        self._name, self._where = name, where
        shapes = [tuple(p.get_shape() if hasattr(p, "get_shape") else p.shape) for p in parts]
        shapes = [s[::-1] for s in shapes] if transposed else shapes
        self._rows = [s[0] for s in shapes]
        self._shape = (sum(self._rows), *shapes[0][1:])

    def get_shape(self) -> tuple:
        return self._shape

    def __getitem__(self, key) -> torch.Tensor:
        rows, cols = key if isinstance(key, tuple) else (key, slice(None))
        start, stop, _ = rows.indices(self._shape[0])
        pieces, offset = [], 0
        for part, n in zip(self._parts, self._rows):
            a, b = max(start - offset, 0), min(stop - offset, n)
            if a < b:
                pieces.append(self._read(part, slice(a, b), cols))
            offset += n
        if not pieces:  # no rows: a TP rank whose vocabulary slice is all padding
            return self._read(self._parts[0], slice(0, 0), cols)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def _read(self, part, rows: slice, cols: slice) -> torch.Tensor:
        if len(self._shape) == 1:
            t = part[rows]
        else:
            t = part[cols, rows].t() if self._transposed else part[rows, cols]
        checked_weight(self._name, t, self._where)
        keep = self._dtype is None  # dtype None: as stored
        return t.to(self._device, t.dtype if keep else self._dtype).contiguous()


def lazy_checkpoint(path, device="cpu", dtype=torch.float32) -> tuple[ModelConfig, dict]:
    """(config, our name -> LazyTensor) of a HuggingFace folder, checked against its config.json; no tensor
    data is read until a LazyTensor is indexed."""
    config = checkpoint_config(path)
    slices = _open_weights(_weight_files(Path(path)), slices=True)
    key_map, hf_keys, expected = checked_key_map(slices, config)
    out = {}
    for key, (source, conv1d) in key_map.items():
        names = source_names(source)
        parts = ([StackedView(slices[hf_keys[source.name]], source)] if isinstance(source, Stacked)
                 else [slices[hf_keys[s]] for s in names])
        out[key] = LazyTensor(parts, conv1d, device, dtype, "/".join(names), path)
        check_shape(source, out[key].get_shape(), expected[key])
    return config, out


RANK_KEY = "syntorch_rank"  # in each rank file's safetensors metadata: the rank it was cut for
SHARD_INDEX = "syntorch_shards.json"  # what makes a folder a `syntorch shard` folder
SHARD_FORMAT = "syntorch-shards"
SHARD_VERSION = 1


@dataclass(frozen=True)
class ShardIndex:
    """A `syntorch shard` folder: one safetensors file per rank holding only that rank's slices."""
    config: ModelConfig
    tp: int
    pp: int
    files: dict  # global rank (as parallel/mesh.py numbers them: Mesh.rank_of) -> file name
    tensors: dict  # global rank -> the names of the tensors in its file
    layers: dict  # global rank -> [first, last + 1] of the stage's layers

    def to_dict(self) -> dict:
        return {"format": SHARD_FORMAT, "version": SHARD_VERSION, "tp": self.tp, "pp": self.pp,
                "model_config": self.config.to_dict(),
                "ranks": {str(r): {"file": self.files[r], "layers": self.layers[r], "tensors": self.tensors[r]}
                          for r in sorted(self.files)}}


def read_shard_index(path) -> ShardIndex:
    """The index of a shard folder, every field checked (a stranger's JSON: known fields only)."""
    index = Path(path) / SHARD_INDEX
    d = _read_json(index)
    if d.get("format") != SHARD_FORMAT or d.get("version") != SHARD_VERSION:
        raise UserError(f"{index} is not a {SHARD_FORMAT} index of version {SHARD_VERSION}; re-run syntorch shard")
    tp, pp, ranks = d.get("tp"), d.get("pp"), d.get("ranks")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (tp, pp)) or not isinstance(ranks, dict):
        raise UserError(f"{index}: 'tp' and 'pp' must be positive integers and 'ranks' an object; re-run syntorch shard")
    if len(ranks) != tp * pp or set(ranks) != {str(r) for r in range(tp * pp)}:  # len first: tp may be 10**18
        raise UserError(f"{index} lists ranks {few_names(ranks)} but tp {tp} x pp {pp} needs ranks 0..{tp * pp - 1}; "
                        "re-run syntorch shard")
    files, tensors, layers = {}, {}, {}
    for r in range(tp * pp):
        entry = ranks[str(r)]
        ok = (isinstance(entry, dict) and isinstance(entry.get("file"), str) and Path(entry["file"]).name == entry["file"]
              and isinstance(entry.get("tensors"), list) and all(isinstance(t, str) for t in entry["tensors"])
              and isinstance(entry.get("layers"), list) and len(entry["layers"]) == 2)
        if not ok:
            raise UserError(f"{index}: rank {r} needs 'file' (a name in the folder), 'layers' and 'tensors'; "
                            "re-run syntorch shard")
        files[r], tensors[r], layers[r] = entry["file"], entry["tensors"], entry["layers"]
    config = config_from_dict(d.get("model_config"), source=f"{index} model_config")
    return ShardIndex(config, tp, pp, files, tensors, layers)


def check_shard_layout(path, tp: int, pp: int) -> ShardIndex | None:
    """For a shard folder (None for a HuggingFace one): the run's --tp/--pp must be the folder's, and every
    rank's file present with the tensors its index names (safetensors checks each header against the file's
    size, so a truncated file is caught here, before any rank starts)."""
    if not (Path(path) / SHARD_INDEX).is_file():
        return None
    index = read_shard_index(path)
    if (index.tp, index.pp) != (tp, pp):
        raise UserError(f"{path} is sharded for --tp {index.tp} --pp {index.pp} but this run has --tp {tp} --pp {pp}; "
                        f"run with --tp {index.tp} --pp {index.pp}, or re-shard the HuggingFace folder with "
                        f"syntorch shard --tp {tp} --pp {pp}")
    for rank in index.files:
        rank_file(path, index, rank)
    return index


def rank_file(path, index: ShardIndex, rank: int) -> dict:
    """name -> zero-argument reader of the tensors in `rank`'s file, checked against the index."""
    f = Path(path) / index.files[rank]
    if not f.is_file():
        raise UserError(f"rank {rank}'s file {f} is missing; re-run syntorch shard into a new folder")
    getters = _open_weights([f])
    if sorted(getters) != sorted(index.tensors[rank]):
        raise UserError(f"{f} does not hold the tensors {SHARD_INDEX} lists for rank {rank}; re-run syntorch shard")
    written_for = _file_rank(f)
    if written_for is not None and written_for != str(rank):
        raise UserError(f"{f} was cut for rank {written_for}, not rank {rank} (files swapped or linked); "
                        "re-run syntorch shard into a new folder")
    return {name: (lambda name=name, read=read: checked_weight(name, read(), f)) for name, read in getters.items()}
