"""Plain PyTorch models. Nothing here knows about tracing or parallelism.

Every family keeps its transformer blocks in a ModuleDict named `layers`, so block i's modules are
`layers.{i}.…` in every model, stage, trace and checkpoint map; LAYER_PATH and layer_path say so once.
"""
import contextlib
import copy
import re

import torch
from torch.overrides import TorchFunctionMode

from syntorch.config import ModelConfig
from syntorch.models.bert import Bert
from syntorch.models.gpt import GPT
from syntorch.models.layers import init_weights
from syntorch.nodynamo import skip_dynamo_until_loaded


LAYER_PATH = re.compile(r"^layers\.(\d+)(?=\.|$)")  # a module path inside block i; group 1 is i


def layer_path(index: int) -> str:
    return f"layers.{index}"


class _SkipInit(TorchFunctionMode):
    """Turns torch.nn.init's random fills (normal_, uniform_, kaiming_uniform_, trunc_normal_: the ones that
    defer to torch-function modes) into no-ops. On meta they compute nothing, yet their Python reference
    kernels import torch's compiler stack (torch._dynamo, ~1.5 s) on first use."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta():
    """Modules built inside have meta parameters, without torch's default init (a meta tensor holds no
    values; real weights come from init_weights or a checkpoint)."""
    skip_dynamo_until_loaded()  # what runs on meta next needs no compiler
    with torch.device("meta"), _SkipInit():
        yield


def module_view(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose own children may be replaced without touching `model`: every submodule,
    parameter and buffer is shared (deepcopy is told they are copied already), only the top module's tables
    are its own. Pipeline chunks and first-layer traces are such views."""
    shared = {id(t): t for t in (*model.modules(), *model.parameters(), *model.buffers()) if t is not model}
    return copy.deepcopy(model, shared)


def build_model(config: ModelConfig, device="cpu", dtype=torch.float32):
    """A randomly initialised model (GPT-2's scheme for the GPT family, BERT's for BERT: see init_weights);
    on `meta` it takes no memory and no init time."""
    with on_meta():  # skips torch's default init, which we would overwrite anyway
        model = (GPT if config.arch == "gpt" else Bert)(config)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        init_weights(model, residual_layers=config.n_layer if config.arch == "gpt" else 0)
        model.tie_weights()
    return model.to(dtype).eval()
