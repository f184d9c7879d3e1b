"""Every command in the README's code blocks runs as written, in order, in one folder (later commands read
what earlier ones wrote), each on a stated small variant of the model it names: the same family, shapes
small enough for a test, degrees that still divide. Inputs the README leaves to the reader (checkpoints,
tokenizers, SQuAD, captured traces) are made here or taken from an earlier command."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from train_data import make_model, make_squad, make_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"
SMALL = {  # the stated small variants
    "gpt3-125m": {"n_layer": 2, "d_model": 64, "n_head": 4, "vocab_size": 512, "n_positions": 64},
    "gpt3-175b": {"n_layer": 8, "d_model": 128, "n_head": 8, "vocab_size": 512},
    "gptj-6b": {"n_layer": 2, "d_model": 128, "n_head": 8, "rotary_dim": 8, "vocab_size": 512},
    "mixtral-8x22b": {"n_layer": 4, "d_model": 64, "n_head": 4, "n_kv_head": 2, "d_ff": 64, "vocab_size": 512},
    "gpt2": {"n_layer": 2, "d_model": 64, "n_head": 4, "vocab_size": 512, "n_positions": 64},
    "bert-base-uncased": {"n_layer": 2, "d_model": 64, "n_head": 4, "vocab_size": 512, "n_positions": 64},
}
FAMILY_DEFAULT = {"train gpt2": "gpt2", "syntorch.train bert": "bert-base-uncased"}


def readme_commands() -> list[str]:
    """The syntorch and torchrun lines of the README's bash blocks (the test command itself excluded)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    lines = [line.removeprefix("pip install -e . && ") for line in lines]
    return [line for line in lines if line.startswith(("syntorch ", "torchrun "))]


def small_variant(command: str, ws: Path) -> list[str]:
    """The command on the stated small variants and the inputs made in `ws`."""
    for name in SMALL:
        command = re.sub(rf"--model {re.escape(name)}(?=\s|$)", f"--model_config {ws / name}.json", command)
    for words, name in FAMILY_DEFAULT.items():
        if words in command and "--model" not in command:
            command = command.replace(words, f"{words} --model_config {ws / name}.json")
    for placeholder, real in {"path/to/hf_gpt2": ws / "hf_gpt2", "path/to/hf_bert": ws / "hf_bert",
                              "path/to/tokenizer": ws / "tok", "path/to/bert_tokenizer": ws / "tok",
                              "squad.json": ws / "squad.json", "H.json": "outputs/gpt2_2rank_host.0.json",
                              "D.json": "outputs/gpt2_2rank_device.0.json"}.items():
        command = command.replace(placeholder, str(real))
    command = re.sub(r"\s\[--\w+ [^\]]*\]", "", command)  # an optional flag shown as [--flag a|b]
    argv = shlex.split(command)
    if argv[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", *argv[1:]]
    return argv  # the installed `syntorch` command, as a reader types it


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme_inputs")
    for name, fields in SMALL.items():
        (root / f"{name}.json").write_text(json.dumps({"base": name, **fields}))
    make_squad(root / "squad.json")
    make_tokenizer(root / "tok")
    for folder, base in (("hf_gpt2", "gpt2"), ("hf_bert", "bert-base-uncased")):
        make_model(root / folder, base)
        make_tokenizer(root / folder)
    return root


def test_the_readme_has_the_commands_this_test_knows():
    commands = readme_commands()
    assert len(commands) >= 15 and commands[0].startswith("syntorch infer --model gpt3-125m")
    named = set(re.findall(r"--model (\S+)", " ".join(commands)))
    assert named <= set(SMALL), f"give these models a small variant: {named - set(SMALL)}"


def test_every_readme_command_runs_as_written(ws, tmp_path):
    for command in readme_commands():
        argv = small_variant(command, ws)
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{command}\n{' '.join(argv)}\n{done.stderr[-3000:]}"
