"""Every command in the README's code blocks runs as written, in order, in one folder (later commands read
what earlier ones wrote), each on a stated small variant of the model it names: the same family, shapes
small enough for a test, degrees that still divide. Inputs the README leaves to the reader (checkpoints,
tokenizers, SQuAD, captured traces) are made here or taken from an earlier command.

The commands run two at a time (most start one process on a 2-core machine), but a command starts only after
every earlier one whose paths meet its own (`touched`): one reading what another writes, or two writing the
same place. Commands whose paths do not meet share no file, so their order cannot change what either does."""
import json
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path, PurePath

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
# flags whose value is a path (convert's --device is a file, infer's a device name), and the places a command
# writes when it leaves its output flags out (syntorch's defaults)
PATH_FLAGS = {"--out", "--output", "--input", "--host", "--device", "--data", "--tokenizer", "--checkpoint",
              "--trace-output-dir", "--save-dir", "--merged", "--comm_groups", "--comm-groups"}
DEVICES = {"cpu", "cuda", "meta"}
DEFAULT_OUTPUTS = {"infer": {"--out": "runs"}, "trace": {"--out": "runs"}, "plan": {"--out": "runs"},
                   "predict": {"--out": "runs"}, "train": {"--trace-output-dir": "outputs", "--save-dir": "checkpoints"}}


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


def touched(argv: list[str]) -> set[PurePath]:
    """The relative paths a command may read or write: its positional words, the values of PATH_FLAGS and the
    default outputs of the output flags it leaves out (absolute paths are this test's inputs, only read)."""
    words, flags = [], set()
    for i, word in enumerate(argv[2:], 2):
        if word.startswith("-"):
            flags.add(word.split("=")[0])
        elif not argv[i - 1].startswith("-") or argv[i - 1] in PATH_FLAGS:  # not some other flag's value
            words.append(word)
    subcommand = "train" if "syntorch.train" in argv else argv[1]
    words += [path for flag, path in DEFAULT_OUTPUTS.get(subcommand, {}).items() if flag not in flags]
    return {PurePath(word) for word in words if not PurePath(word).is_absolute() and word not in DEVICES}


def meet(a: set[PurePath], b: set[PurePath]) -> bool:
    return any(p == q or p in q.parents or q in p.parents for p in a for q in b)


def run_after(earlier, argv, cwd):
    wait(earlier)
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=900)


def test_a_command_waits_for_the_earlier_ones_whose_paths_it_meets(ws):
    commands = readme_commands()
    paths = [touched(small_variant(command, ws)) for command in commands]

    def first(start):
        return paths[next(i for i, command in enumerate(commands) if command.startswith(start))]

    capture = first("syntorch train gpt2")
    assert meet(capture, first("syntorch convert")) and meet(capture, first("syntorch compare"))  # outputs/
    assert meet(first("syntorch export"), paths[0])  # runs/demo/tensor_trace_graph.json
    assert not meet(first("syntorch export"), first("syntorch plan"))
    assert not meet(paths[0], paths[1]) and not meet(capture, paths[0])  # runs/demo, runs/tp2, outputs


def test_every_readme_command_runs_as_written(ws, tmp_path):
    commands = readme_commands()
    argvs = [small_variant(command, ws) for command in commands]
    runs = []
    with ThreadPoolExecutor(2) as pool:  # FIFO: every earlier command has started before a later one waits on it
        for i, argv in enumerate(argvs):
            earlier = [runs[j] for j in range(i) if meet(touched(argvs[j]), touched(argv))]
            runs.append(pool.submit(run_after, earlier, argv, tmp_path))
    for command, argv, run in zip(commands, argvs, runs):
        done = run.result()
        assert done.returncode == 0, f"{command}\n{' '.join(argv)}\n{done.stderr[-3000:]}"
