"""Start-up (issue 24): commands import only what they use. Each check runs in a fresh process, since which
modules a process imported is process-wide (this pytest process may have imported torch._dynamo already)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WATCHED = ["torch", "torch._dynamo", "matplotlib", "google.protobuf"]


def imported_by(code: str) -> set[str]:
    """The watched modules a fresh interpreter has imported once `code` has run."""
    check = f"import json, sys\n{code}\nprint(json.dumps([m for m in {WATCHED!r} if m in sys.modules]))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-P", "-c", check], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def command(*args: str) -> str:
    return f"from syntorch.cli import main\nassert main({list(args)!r}) == 0"


def test_help_imports_no_torch():
    assert imported_by(command("--help")) == set()


def test_symbolic_infer_imports_no_compiler_no_drawing_no_protobuf(tmp_path):
    """TP2 on meta with a prediction: Python meta kernels, the tensor-parallel shards' cat, the dispatch mode."""
    run = command("infer", "--model", "gpt2", "--device", "meta", "--tp", "2", "--num_input_tokens", "16",
                  "--num_output_tokens", "2", "--hw_config", "h100-sxm", "--out", str(tmp_path / "run"))
    assert imported_by(run) == {"torch"}


def test_chakra_and_images_import_their_libraries_when_asked(tmp_path):
    """The reference for the test above: the same run writing images and Chakra does import them."""
    run = command("infer", "--model", "gpt2", "--device", "meta", "--num_input_tokens", "16",
                  "--num_output_tokens", "2", "--visualize_trace", "--chakra", "--out", str(tmp_path / "run"))
    assert imported_by(run) == {"torch", "matplotlib", "google.protobuf"}


def test_training_trace_imports_no_compiler(tmp_path):
    """The traced step calls Adam's step without torch.optim's wrapper (nodynamo.plain_step), which imports
    torch._dynamo for graph breaks."""
    run = command("trace", "--model", "gpt2", "--mode", "train", "--seq", "64", "--tp", "2",
                  "--out", str(tmp_path / "trace"), "--no_progress")
    assert "torch._dynamo" not in imported_by(run)


def test_meta_ops_give_the_same_results_and_dynamo_is_used_once_loaded():
    """The stand-in runs each wrapped function as torch's wrapper would: same shapes and dtypes on meta
    (type promotion, cat, gelu) as on CPU, without torch._dynamo; once torch._dynamo is imported, the
    wrapper it stands in for is built and used."""
    code = """
import torch
from syntorch.nodynamo import skip_dynamo_until_loaded
skip_dynamo_until_loaded()
def ops(device):
    a = torch.ones(3, 4, device=device, dtype=torch.bfloat16)
    b = torch.ones(4, device=device, dtype=torch.float32)
    outs = [a + b, a - 1, torch.cat([a, a], 1), torch.nn.functional.gelu(a), torch.where(b > 0, b, 2 * b)]
    return [(o.shape, o.dtype) for o in outs]
assert ops("meta") == ops("cpu")
assert "torch._dynamo" not in sys.modules
cat = torch._refs.cat.__wrapped__  # out_wrapper -> torch._disable_dynamo's wrapper
stand_in = getattr(cat.__closure__[cat.__code__.co_freevars.index("fn")].cell_contents, "__dynamo_disable")
assert stand_in.disabled is None
import torch._dynamo
torch.cat([torch.ones(2, device="meta")] * 2)
assert stand_in.disabled is not None
"""
    assert "torch._dynamo" in imported_by(code)
