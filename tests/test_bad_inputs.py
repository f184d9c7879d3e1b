"""Every command with its bad inputs (issue 17): each is refused with exit code 2 and exactly one stderr line
`syntorch <command>: error: ...` saying what to fix, with no traceback, nothing on stdout and nothing written:
the output is absent afterwards, or byte-identical when it was there before (a user's file, or an earlier
run's folder that the --force given would have replaced).

Three parts: a table of cases per command; rows made by walking the parsers (every float option refuses nan
and infinity, every int option -1, and 0 unless 0 means something), so a new option is covered when it is
added; and a seeded fuzz of `.et` bytes that `syntorch validate` must answer cleanly and quickly.
Commands run in-process on tiny models (about 15 s in all)."""
import json
import os
import random
import shlex
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from chakra_graphs import pp_rank, tp_rank
from conftest import tiny_config
from tests.chakra.test_validate import tp_pp_rank
from train_data import make_model, make_squad, make_tokenizer

from syntorch.chakra.writer import write_chakra
from syntorch.cli import build_parser, main
from syntorch.config import save_model_config
from syntorch.export import networkx_json
from syntorch.hardware import PRESETS
from syntorch.options import Parser
from syntorch.outdir import MANIFEST
from syntorch.shard_files import write_shards
from syntorch.train.__main__ import main as train_module_main
from syntorch.train.arguments import add_arguments as train_arguments

USER_BYTES = b"a user's file\n"


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """What the commands read, good and bad."""
    root = tmp_path_factory.mktemp("inputs")
    save_model_config(tiny_config("gpt2"), root / "tiny.json")  # 2 layers, 4 heads, context 64, vocab 128
    texts = {
        "notjson.json": "{nodes",
        "list.json": "[1, 2]",
        "twelve.json": json.dumps({"base": "gpt2", "n_head": "twelve"}),
        "nan_eps.json": '{"base": "gpt2", "ln_eps": NaN}',
        # DeepSeek-V3's layout (MLA, its routing) at 4 heads
        "mla.json": json.dumps({"base": "deepseek-v3", "name": "tiny-mla", "n_layer": 2, "d_model": 64, "n_head": 4,
                                "d_head": 24, "rotary_dim": 8, "d_ff": 64, "n_experts": 16, "d_ff_expert": 16,
                                "first_k_dense": 1, "vocab_size": 128}),
        "nan_hw.json": json.dumps({**PRESETS["h100-sxm"].to_dict(), "memory_bw_gb_s": float("nan")}),
        "no_sm_hw.json": json.dumps({k: v for k, v in PRESETS["a100-80gb"].to_dict().items() if k != "sm_count"}),
        "negative_hw.json": json.dumps({**PRESETS["a100-80gb"].to_dict(), "gemm_efficiency": -0.8}),
        "nodes_only.json": json.dumps({"nodes": [{"id": 0}], "edges": []}),
        "huge.json": json.dumps({"base": "gpt2", "d_model": 10**15, "n_head": 1}),  # was: storage overflow
        "dangling.json": json.dumps({"nodes": [{"id": 0, "kind": "op", "name": "aten.mm"}],
                                     "edges": [{"source": 0, "target": 7}]}),
        "no_kind.json": json.dumps({"directed": True, "multigraph": False, "graph": {}, "edges": [],
                                    "nodes": [{"id": 0, "kind": "collective", "name": "allreduce"}]}),
        "squad_bad.json": '{"data": 3}',
        "badckpt/config.json": "{",
        "noweights/config.json": json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                             "vocab_size": 32, "n_positions": 64, "n_embd": 32, "n_layer": 2,
                                             "n_head": 4}),
        "corrupt/bad.0.et": "\x05abc",
        "empty/bad.0.et": "",
        "nothing/notes.txt": "no traces here",
        "blank.txt": "\n  \n",
        "long.txt": "the cat sat " * 40 + "\n",
        "kv3.json": json.dumps({"base": "llama-3-8b", "n_kv_head": 3}),
        "topk.json": json.dumps({"base": "mixtral-8x7b", "moe_top_k": 9}),
        "kv6.json": json.dumps({"base": "llama-3-8b", "n_layer": 2, "d_model": 96, "n_head": 12, "n_kv_head": 6,
                                "d_ff": 64, "vocab_size": 128, "n_positions": 64}),
        "moe.json": json.dumps({"base": "mixtral-8x7b", "n_layer": 2, "d_model": 64, "n_head": 4, "n_kv_head": 2,
                                "d_ff": 64, "vocab_size": 128, "n_positions": 64}),
        "gemma/config.json": json.dumps({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}),
    }
    for name, text in texts.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    networkx_json.export(tp_rank(0), root / "graph.json")  # one rank of a TP-2 run, with collectives
    networkx_json.export(pp_rank(0), root / "pipe.json")  # one stage of a 2-stage pipeline: not pure TP
    write_chakra({r: tp_rank(r) for r in range(2)}, root / "chakra")
    write_chakra({r: tp_rank(r) for r in range(2)}, root / "two", model_name="a")
    (root / "two" / "b.0.et").write_bytes((root / "two" / "a.0.et").read_bytes())
    (root / "dir_et" / "a.0.et").mkdir(parents=True)
    (root / "fifo_et").mkdir()
    os.mkfifo(root / "fifo_et" / "x.0.et")  # was: validate and predict blocked reading it
    make_squad(root / "squad.json")
    make_tokenizer(root / "tok")
    make_model(root / "bert", "bert-base-uncased")
    make_model(root / "gpt2", "gpt2")  # tiny HF folder (2 layers, 4 heads) to shard
    write_shards(root / "gpt2", root / "sharded", tp=2, pp=1)
    damaged_weights(root)
    (root / "pickled").mkdir()  # a .bin whose pickle would run a command: refused, never run
    shutil.copy(root / "gpt2" / "config.json", root / "pickled" / "config.json")
    torch.save({"w": RunsCode()}, root / "pickled" / "pytorch_model.bin")
    shutil.copytree(root / "gpt2", root / "outside_index")  # an HF index pointing outside its folder
    (root / "outside_index" / "model.safetensors").unlink()
    (root / "outside_index" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"transformer.wte.weight": "/etc/hostname"}}))
    shutil.copytree(root / "sharded", root / "swapped")  # two ranks' files swapped (was: loaded, other tokens)
    for a, b in (("rank00000", "tmp"), ("rank00001", "rank00000"), ("tmp", "rank00001")):
        (root / "swapped" / f"{a}.safetensors").rename(root / "swapped" / f"{b}.safetensors")
    for broken in ("norank", "truncated"):
        shutil.copytree(root / "sharded", root / broken)
    (root / "norank" / "rank00001.safetensors").unlink()
    shutil.copytree(root / "sharded", root / "huge_tp")  # was: 10**18 rank names built
    index = json.loads((root / "huge_tp" / "syntorch_shards.json").read_text())
    (root / "huge_tp" / "syntorch_shards.json").write_text(json.dumps({**index, "tp": 10**18}))
    (root / "truncated" / "rank00001.safetensors").write_bytes((root / "sharded" / "rank00001.safetensors").read_bytes()[:999])
    return root


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/syntorch-pickle-ran",))


def damaged_weights(root: Path) -> None:
    """Copies of the tiny GPT-2 with one weight as int32 or NaN, and shards with a NaN."""
    from safetensors.torch import load_file, save_file

    name = "transformer.h.0.attn.c_attn.weight"
    for folder, change in (("int_weights", lambda t: t.to(torch.int32)), ("nan_weights", lambda t: t * float("nan"))):
        shutil.copytree(root / "gpt2", root / folder)
        state = load_file(root / folder / "model.safetensors")
        save_file({**state, name: change(state[name])}, root / folder / "model.safetensors")
    shutil.copytree(root / "sharded", root / "nan_shards")
    state = load_file(root / "nan_shards" / "rank00001.safetensors")
    first = sorted(state)[0]
    save_file({**state, first: state[first] * float("nan")}, root / "nan_shards" / "rank00001.safetensors")


# ---- running a case ----------------------------------------------------------------------------------

def prepare(case_dir: Path) -> dict:
    """The places every case may name: a user's file and folder, an earlier run's folder, a folder named
    like a picture. They are inside the case's folder, so the check that nothing changed covers them."""
    places = {"userfile": case_dir / "notes.txt", "userdir": case_dir / "mine", "earlier": case_dir / "earlier",
              "folder_png": case_dir / "pictures.png", "taken": case_dir / "taken"}
    places["userfile"].write_bytes(USER_BYTES)
    for folder in ("userdir", "folder_png", "taken"):
        places[folder].mkdir()
        (places[folder] / "notes.txt").write_bytes(USER_BYTES)
    for name in RUN_FILES:  # a user's files with the names a run writes: never replaced
        (places["taken"] / name).write_bytes(USER_BYTES)
    earlier_run(places["earlier"])
    return places


RUN_FILES = ("run.json", "summary.json", "comm_groups.json", "model.json", "syntorch_shards.json")  # one per command


def earlier_run(folder: Path) -> None:
    """An earlier run's folder that wrote (among others) the names the commands write."""
    folder.mkdir()
    for name in ("old.txt", *RUN_FILES):
        (folder / name).write_text("an earlier run's output\n")
    (folder / MANIFEST).write_text(json.dumps({"syntorch_version": "0", "complete": True,
                                               "files": sorted(["old.txt", *RUN_FILES])}))


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else "folder"
            for p in sorted(folder.rglob("*"))}


def refused(argv: list[str], message: str, case_dir: Path, capsys, entry=main, prog: str | None = None) -> None:
    """Runs `argv` and checks the refusal: exit 2, one line naming `message`, and case_dir unchanged."""
    before = snapshot(case_dir)
    code = entry(argv)
    out, err = capsys.readouterr()
    prog = prog or f"syntorch {argv[0]}"
    assert "Traceback" not in out + err, err
    assert (code, out) == (2, ""), (code, out, err)
    assert err.endswith("\n") and len(err.splitlines()) == 1 and err.startswith(f"{prog}: error: "), err
    assert message in err, err
    assert snapshot(case_dir) == before, "the refused command wrote, changed or removed files"


@pytest.fixture
def case_dir(tmp_path, monkeypatch):
    """The case's own folder, also its working directory (train's default outputs land in it) and the
    calibrate cache."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SYNTORCH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


# ---- the table ---------------------------------------------------------------------------------------

@dataclass
class Case:
    argv: str  # shell-quoted; {ws} the inputs, {out} the output, {case}, {userfile}, {userdir}, {taken}, {earlier}, {folder_png}
    message: str  # what the error line must say
    output: str = ""  # the output {out} names, in the case's folder: "out/" a folder, "g.svg" a file, "" none
    name: str = ""  # the test id (default: the command line)

    def id(self) -> str:
        return self.name or f"{self.argv.replace('{ws}/', '')} -> {self.output}"


INFER = "infer --model_config {ws}/tiny.json --num_input_tokens 4 --num_output_tokens 2 --out {out}"
TRACE = "trace --model_config {ws}/tiny.json --seq 16 --no_progress --out {out}"
PLAN = ("plan --model_config {ws}/tiny.json --gpus 2 --hw_config a100-80gb --global_batch 2 --seq 16 --tp 2 "
        "--no_recompute --no_progress --out {out}")
EXPORT = "export --input {ws}/graph.json --output {out}"
COMM = "comm --input {ws}/graph.json --html {out}"
CALIBRATE = "calibrate --seconds 0.01 --output {out}"
CONVERT = "convert --host {ws}/host.json --device {ws}/device.json --rank 0 --output {out}"
SHARD = "shard --checkpoint {ws}/gpt2 --tp 2 --out {out}"
TRAIN = ("train gpt2 --data {ws}/squad.json --tokenizer {ws}/tok --model_config {ws}/tiny.json --device cpu "
         "--max-seq-length 32 --save-dir {out}")


def cases(base: str, output: str, rows: list[tuple[str, str]]) -> list[Case]:
    """`base` with each row's options added: (options, message)."""
    return [Case(f"{base} {extra}", message, output, f"{base.split()[0]} {extra.replace('{ws}/', '')}")
            for extra, message in rows]


CASES = [
    *cases(INFER, "out/", [
        ("--model gpt4", "unknown model 'gpt4'"),
        ("--model_config {ws}/missing.json", "missing.json not found"),
        ("--model_config {ws}/notjson.json", "notjson.json is not valid JSON"),
        ("--model_config {ws}/list.json", "expected a JSON object of model fields"),
        ("--model_config {ws}/twelve.json", "field 'n_head' must be int, got 'twelve'"),
        ("--model_config {ws}/nan_eps.json", "ln_eps must be a positive finite number, got nan"),
        ("--checkpoint {ws}/missing", "checkpoint folder not found"),
        ("--checkpoint {ws}/badckpt", "config.json is not valid JSON"),
        ("--checkpoint {ws}/noweights", "model.safetensors"),
        ("--checkpoint {ws}/int_weights", "tensor transformer.h.0.attn.c_attn.weight is int32, not floating point"),
        ("--checkpoint {ws}/int_weights --tp 2", "tensor transformer.h.0.attn.c_attn.weight is int32"),
        ("--checkpoint {ws}/nan_weights", "tensor transformer.h.0.attn.c_attn.weight holds NaN or infinity"),
        ("--model_config {ws}/huge.json --device meta", "past what any device can index (1.15e+18); check d_model"),
        ("--checkpoint {ws}/pickled", "holds objects other than tensors (a pickle that could run code)"),
        ("--checkpoint {ws}/nan_weights --tp 2", "transformer.h.0.attn.c_attn.weight holds NaN or infinity"),
        ("--checkpoint {ws}/nan_shards --tp 2", "holds NaN or infinity"),
        ("--batch_size 100000000000", "lower --batch_size"),
        ("--batch_size 100000000000 --device meta", "lower --batch_size"),
        ("--hw_config no-such-gpu", "unknown --hw_config 'no-such-gpu'"),
        ("--hw_config {ws}/missing.json", "missing.json not found"),
        ("--hw_config {ws}/notjson.json", "is not valid JSON"),
        ("--hw_config {ws}/nan_hw.json", "memory_bw_gb_s must be a finite number, got nan"),
        ("--temperature -1", "--temperature must be >= 0"),
        ("--top_p 0", "--top_p must be in (0, 1]"),
        ("--top_p 1.5", "--top_p must be in (0, 1]"),
        ("--num_input_tokens 2000", "exceed the context"),
        ("--num_output_tokens 2000", "exceed the context"),
        ("--tp 3", "--tp 3 does not divide tiny-gpt2's attention heads (4); choose --tp from 1, 2, 4"),
        ("--tp 8 --device meta", "--tp 8 is larger than tiny-gpt2's 4 attention heads; use a --tp that divides 4"),
        ("--model_config {ws}/mla.json --tp 8 --device meta",
         "--tp 8 is larger than tiny-mla's 4 attention heads; use a --tp that divides 4"),
        ("--seed 18446744073709551616", "--seed must fit in 64 bits (below 2**63), got 18446744073709551616"),
        ("--device cuda", "CUDA is not available"),
        ("--device tpu", "--device 'tpu'"),
        ("--dtype fp64", "argument --dtype: invalid choice: 'fp64'"),
        ("--input_ids 1,2,999", "--input_ids token id 999 is outside the vocabulary of tiny-gpt2 (0..127)"),
        ("--input_ids 1,x", "expected comma-separated integers like 1,2,3, got '1,x'"),
        ("--stop_tokens 999", "--stop_tokens token id 999 is outside the vocabulary"),
        ("--prompt hello", "--prompt needs --tokenizer"),
        ("--prompt hello --tokenizer {ws}/missing", "no tokenizer.json in"),
        ("--input_ids 1 --prompt hello --tokenizer {ws}/tok", "give either --input_ids or --prompt"),
        ("--sp", "--sp (sequence parallel) splits TP regions along the sequence; it needs --tp > 1"),
        ("--comm_debug 5", "--comm_debug must be 0, 1, 2 or 3, got 5"),
        ("--trace_level bogus", "argument --trace_level: invalid choice: 'bogus'"),
        ("--num_output_tokens two", "argument --num_output_tokens: invalid int value: 'two'"),
        ("--no_such_option 1", "unrecognized arguments: --no_such_option 1"),
        ("--pp 5", "--pp 5 is larger than the model's 2 layers; each stage needs a layer"),
        ("--pp 0", "--pp must be positive, got 0"),
        ("--pp 2 --tp 2 --sp", "--sp with --pp is not supported for inference"),
        ("--pp 2 --chakra", "traces of a --pp run are made symbolically: add --device meta"),
        ("--prompt_file {ws}/missing.txt --tokenizer {ws}/tok", "missing.txt not found"),
        ("--prompt_file {ws}/blank.txt --tokenizer {ws}/tok", "blank.txt is empty; give one prompt per line"),
        ("--prompt_file /dev/null --tokenizer {ws}/tok", "/dev/null is not a regular file (a folder, device or FIFO)"),
        ("--model_config /dev/zero", "/dev/zero is not a regular file"),
        ("--checkpoint {ws}/outside_index", "names '/etc/hostname', not a file of"),
        ("--prompt_file {ws}/long.txt --tokenizer {ws}/tok", "exceed the context of tiny-gpt2 (64)"),
        ("--prompt_file {ws}/blank.txt", "--prompt_file needs --tokenizer"),
        ("--input_ids 1,2 --input_ids 3 --batch_size 3", "--batch_size 3 does not match the 2 prompts given"),
    ]),
    *cases(INFER.replace("{out}", ""), "", [
        ("{userfile}", "exists and is not a folder"),
        ("{taken}", "which syntorch did not write; move it away"),
        ("{earlier}", "pass --force to replace them"),
    ]),
    *cases(TRACE, "out/", [
        ("--model gpt4", "unknown model 'gpt4'"),
        ("--model_config {ws}/notjson.json", "is not valid JSON"),
        ("--pp 5", "--pp 5 is larger than the model's 2 layers"),
        ("--tp 3", "--tp 3 does not divide"),
        ("--sp", "it needs --tp > 1"),
        ("--tp 2 --sp --seq 15", "--sp needs --seq (15) divisible by --tp (2)"),
        ("--zero 4", "--zero must be 0 (DDP), 1, 2 or 3 (FSDP), got 4"),
        ("--zero 1", "--zero 1 shards over the data-parallel group; it needs --dp > 1"),
        ("--dp 2 --zero 1 --mode infer", "drop --zero"),
        ("--bucket_mb 0", "--bucket_mb must be positive, got 0.0"),
        ("--seq 100", "--seq 100 must be in 1..64"),
        ("--dp 2 --tp 2 --world_size 8", "dp(2) * pp(1) * tp(2) = 4 but the world has 8 ranks"),
        ("--dp 2 --microbatches 3 --global_batch 8", "--global_batch 8 is not dp(2) * microbatches(3)"),
        ("--hw_config no-such-gpu", "unknown --hw_config 'no-such-gpu'"),
        ("--hw_config {ws}/nan_hw.json", "memory_bw_gb_s must be a finite number"),
        ("--schedule zigzag", "argument --schedule: invalid choice: 'zigzag'"),
        ("--mode eval", "argument --mode: invalid choice: 'eval'"),
        ("--trace_level layer", "argument --trace_level: invalid choice: 'layer'"),
        ("--seq abc", "argument --seq: invalid int value: 'abc'"),
        ("--dp 2 --ep 2", "--ep 2 splits the experts of a mixture-of-experts model; tiny-gpt2 has none"),
        ("--dp 2 --ep 3", "--ep 3 must divide --dp 2"),
        ("--pp 2 --microbatches 2 --virtual_stages 2", "--virtual_stages 2 must divide the layers per stage: "
                                                       "2 layers over --pp 2 is 1 per stage"),
        ("--pp 2 --microbatches 3 --virtual_stages 2", "--microbatches 3 must be a multiple of --pp 2"),
        ("--virtual_stages 2", "it needs --pp > 1"),
        ("--pp 2 --first_stage_layers 1 --last_stage_layers 2", "--first_stage_layers 1 and --last_stage_layers 2 "
         "leave -1 of the model's 2 layers for 0 other stage(s) of --pp 2; the stage counts must sum to 2"),
        ("--pp 2 --microbatches 2 --virtual_stages 2 --account_for_embedding",
         "2 layers with the embedding and loss counted (3) do not divide into --pp 2 x --virtual_stages 2"),
        ("--pp 2 --first_stage_layers 1 --account_for_loss", "use one (Megatron-Core refuses both too)"),
        ("--dp 2 --reshard_after_forward false", "it needs --zero 3 (--fsdp), got --zero 0"),
        ("--grad_reduce_dtype fp16", "argument --grad_reduce_dtype: invalid choice: 'fp16'"),
        ("--cp 3", "--cp 3 cuts the sequence into 2 * cp = 6 equal chunks; --seq 16 does not divide by 6"),
        ("--cp 2 --mode infer", "--mode infer does not take it, drop --cp"),
        ("--cp 2 --tp 4 --sp --seq 36", "make seq / cp divide by tp"),
        ("--fsdp", "--zero 3 shards over the data-parallel group; it needs --dp > 1"),
        ("--dp 2 --cp 2 --tp 2 --world_size 4", "dp(2) * pp(1) * cp(2) * tp(2) = 8 but the world has 4 ranks"),
    ]),
    *cases(TRACE.replace("{out}", ""), "", [
        ("{userfile}", "exists and is not a folder"),
        ("{taken}", "which syntorch did not write; move it away"),
        ("{earlier}", "pass --force to replace them"),
    ]),
    Case("export --input {ws}/missing.json --output {out} --format svg", "missing.json not found", "g.svg"),
    Case("export --input {ws}/notjson.json --output {out}", "is not valid JSON", "g.svg"),
    Case("export --input {ws}/list.json --output {out}", "list.json", "g.svg"),
    Case("export --input {ws}/nodes_only.json --output {out}", "nodes_only.json", "g.svg"),
    Case("export --input {ws}/dangling.json --output {out}", "names a node it does not have", "g.svg"),
    *cases(EXPORT, "g.svg", [
        ("--format dot", "unknown --format 'dot'; use one of json, png, svg, graphml, perfetto, chakra"),
        ("--trace_level bogus", "argument --trace_level: invalid choice: 'bogus'"),
    ]),
    Case(f"{EXPORT} --format svg", "--format svg is written to a .svg file, but --output is", "g.png"),
    Case(f"{EXPORT} --format perfetto", "--format perfetto is written to a .json file", "p.svg"),
    Case(f"{EXPORT} --format chakra", "--format chakra is written to a folder or a .json file", "t.et"),
    Case(f"{EXPORT} --format chakra", "--format chakra is written to a folder or a .json file", "t.png"),
    Case(EXPORT, "does not end in a format's suffix (.json, .png, .svg, .graphml); give --format", "g.txt"),
    Case(EXPORT, "does not end in a format's suffix", "out/"),
    Case(f"{EXPORT} --format chakra".replace("graph.json", "pipe.json"), "not pure TP", "out/"),
    *cases("export --input {ws}/graph.json", "", [
        ("--format png --output {folder_png}", "pictures.png is a folder; give a file name"),
        ("--output {folder_png}", "pictures.png is a folder; give a file name"),
        ("--format png --output {userfile}/g.png", "cannot write --output {case}/notes.txt/g.png: {case}/notes.txt is a file"),
        ("--format chakra --output {taken}", "holds comm_groups.json, which syntorch did not write"),
        ("--format chakra --output {earlier}", "pass --force to replace them"),
        ("--format chakra --output {earlier}/model.json", "pass --force to replace them"),
        ("--format svg", "the following arguments are required: --output"),
    ]),
    *cases(COMM, "c.html", [
        ("--noise_level 5", "--noise_level must be 0, 1, 2 or 3, got 5"),
        ("--noise_level x", "argument --noise_level: invalid int value: 'x'"),
        ("--input {ws}/missing.json", "missing.json not found"),
        ("--input {ws}/list.json", "list.json"),
        ("--input {ws}/no_kind.json", "not a syntorch trace: collective node 0 has no known 'collective' kind"),
        ("--log {userfile}/log.txt", "notes.txt/log.txt: {case}/notes.txt is a file, not a folder"),
    ]),
    # all or none: --json is written before --html, and neither is when --html is refused
    Case("comm --input {ws}/graph.json --json {out} --html {userdir}", "--html", "c.json"),
    *cases(CALIBRATE, "cpu.json", [
        ("--seconds 0", "--seconds must be positive, got 0.0"),
        ("--seconds -1", "--seconds must be positive, got -1.0"),
        ("--seconds x", "argument --seconds: invalid float value: 'x'"),
        ("--seconds 1e300", "--seconds must be at most 3600, got 1e+300"),
    ]),
    *cases("calibrate --seconds 0.01", "", [
        ("--output {userdir}", "mine is a folder; give a file name"),
        ("--output {userfile}/cpu.json", "notes.txt/cpu.json: {case}/notes.txt is a file, not a folder"),
    ]),
    Case(CONVERT, "is not named <prefix>.<rank>.et, which syntorch validate and ASTRA-sim look for; for rank 0 "
                  "give e.g.", "trace.et"),
    Case(CONVERT, "is not named <prefix>.<rank>.et, which syntorch validate and ASTRA-sim look for; for rank 0 "
                  "give e.g. {case}/gpt2.0.et", "gpt2.0.json"),
    Case(CONVERT, "is named for rank 1 but --rank is 0; give", "gpt2.1.et"),
    Case(CONVERT, "is named for rank 00 but --rank is 0", "gpt2.00.et"),
    Case(CONVERT, "host trace not found", "gpt2.0.et"),
    Case(CONVERT.replace("host.json", "notjson.json"), "notjson.json is not valid JSON", "gpt2.0.et"),
    Case("convert --host {ws}/host.json --device {ws}/device.json --output {out}",
         "the following arguments are required: --rank", "gpt2.0.et"),
    *cases("validate", "", [
        ("{ws}/nothing", "no <prefix>.<rank>.et files at"),
        ("{ws}/missing/x", "no <prefix>.<rank>.et files at"),
        ("{ws}/corrupt", "bad.0.et: corrupt .et"),
        ("{ws}/empty/bad", "bad.0.et: empty .et file"),
        ("{ws}/two", "holds traces of several prefixes (a, b); give one prefix"),
        ("{ws}/dir_et", "a.0.et is not a regular file (a folder, FIFO or device)"),
        ("{ws}/fifo_et", "x.0.et is not a regular file (a folder, FIFO or device)"),
        ("{ws}/chakra --comm_groups {ws}/missing.json", "comm groups file"),
        ("{ws}/chakra --comm_groups {ws}/list.json", "integer-string keys"),
        ("{ws}/chakra --comm_groups {ws}/notjson.json", "is not valid JSON"),
        ("", "the following arguments are required: path"),
    ]),
    *cases(TRAIN, "ckpt/", [
        ("--data {ws}/missing.json", "data file not found"),
        ("--data {ws}/notjson.json", "not valid JSON"),
        ("--data {ws}/squad_bad.json", "not SQuAD"),
        ("--tokenizer {ws}/missing", "tokenizer folder not found"),
        ("--model-name {ws}/bert", "is a bert model, not gpt2"),
        ("--model-name gpt4", "unknown model 'gpt4'"),
        ("--model gpt4", "unknown model 'gpt4'"),
        ("--model_config {ws}/missing.json", "missing.json not found"),
        ("--model-config {ws}/twelve.json", "field 'n_head' must be int"),
        ("--max-seq-length 1000", "--max-seq-length 1000 must be in 4..64"),
        ("--learning-rate 0", "--learning-rate must be positive, got 0.0"),
        ("--weight-decay -0.1", "--weight-decay must be 0 or more, got -0.1"),
        ("--max-grad-norm -1", "--max-grad-norm must be 0 or more"),
        ("--eval-fraction 1", "--eval-fraction must be below 1"),
        ("--bucket-cap-mb 0", "--bucket-cap-mb must be positive"),
        ("--seed 18446744073709551616", "--seed must fit in 64 bits (below 2**63), got 18446744073709551616"),
        ("--trace-name a/b --enable-tracing", "--trace-name is the prefix of file names"),
        ("--enable-tracing --max-steps 1 --trace-output-dir {case}/traces", "--enable-tracing needs 3 optimizer steps"),
        ("--enable-tracing --trace-output-dir {taken}", "holds comm_groups.json, which syntorch did not write"),
        ("--enable-tracing --trace-output-dir {earlier}", "pass --force to replace them"),
        ("--enable-tracing --trace-output-dir {case}/t --save-dir {case}/t/ckpt", "is inside --trace-output-dir"),
        ("--device tpu", "argument --device: invalid choice: 'tpu'"),
        ("--batch-size four", "argument --batch-size: invalid int value: 'four'"),
    ]),
    Case(TRAIN.replace("train gpt2", "train llama"), "argument family: invalid choice: 'llama'", "ckpt/"),
    Case(TRAIN.replace(" --data {ws}/squad.json", ""), "the following arguments are required: --data", "ckpt/"),
    # issue 16: the Llama layout's models
    *cases(INFER, "out/", [
        ("--model_config {ws}/kv3.json", "n_kv_head (3) must divide n_head (32)"),
        ("--model_config {ws}/topk.json", "moe_top_k must be between 1 and n_experts (8), got 9"),
        ("--checkpoint {ws}/gemma", "model_type 'gemma' (architectures ['GemmaForCausalLM']) is not supported"),
        ("--model_config {ws}/kv6.json --tp 4 --device meta", "--tp 4 neither divides nor is a multiple of"),
    ]),
    *cases("predict --out {out}", "out/", [
        ("{ws}/nothing", "no <prefix>.<rank>.et files at"),
        ("{ws}/corrupt", "bad.0.et: corrupt .et"),
        ("{ws}/fifo_et", "x.0.et is not a regular file (a folder, FIFO or device)"),
        ("{ws}/chakra --profile fused", "--profile chooses how the performance model groups ops into kernels; give --hw_config too"),
        ("{ws}/chakra --hw_config a100-80gb --profile slow", "argument --profile: invalid choice: 'slow'"),
        ("{ws}/chakra --hw_config nope", "unknown --hw_config 'nope'"),
        ("{ws}/chakra --hw_config {ws}/nan_hw.json", "memory_bw_gb_s must be a finite number"),
    ]),
    Case(TRACE + " --predict_only", "--predict_only predicts from a hardware model; give --hw_config", "out/"),
    *cases(INFER, "out/", [  # the performance model (issue 14)
        ("--hw_config a100-80gb --profile tuned", "unknown --profile 'tuned'; use one of eager, fused"),
        ("--hw_config {ws}/no_sm_hw.json", "no_sm_hw.json: missing field(s) sm_count"),
        ("--hw_config {ws}/negative_hw.json", "gemm_efficiency must be > 0, got -0.8"),
        ("--recompute full", "--recompute full recomputes activations in backward, which inference has not"),
    ]),
    *cases(TRACE, "out/", [
        ("--hw_config a100-80gb --profile tuned", "unknown --profile 'tuned'; use one of eager, fused"),
        ("--hw_config {ws}/no_sm_hw.json", "no_sm_hw.json: missing field(s) sm_count"),
        ("--hw_config {ws}/negative_hw.json", "gemm_efficiency must be > 0, got -0.8"),
        ("--dp 1000000000", "= 1,000,000,000 ranks; syntorch models up to 1,048,576: lower the degrees"),
        ("--dp 2 --fsdp --zero 1", "--fsdp is --zero 3; drop --zero 1 or --fsdp"),
        ("--micro_batch_size 100000000000000000", "past what any device can index; lower them"),
        ("--hw_config ''", "argument --hw_config: must name something, got an empty string"),
        ("--profile fused", "--profile fused chooses how predicted durations group ops into kernels; give --hw_config"),
        ("--mode infer --recompute selective", "--recompute selective recomputes activations in backward"),
        ("--recompute some", "argument --recompute: invalid choice: 'some'"),
    ]),
    *cases(INFER, "out/", [
        ("--checkpoint {ws}/sharded", "is sharded for --tp 2 --pp 1 but this run has --tp 1 --pp 1"),
        ("--checkpoint {ws}/norank --tp 2", "rank 1's file"),
        ("--checkpoint {ws}/swapped --tp 2", "rank00000.safetensors was cut for rank 1, not rank 0 (files swapped"),
        ("--hw_config ''", "argument --hw_config: must name something, got an empty string"),
        ("--profile fused", "give --hw_config too"),
        ("--checkpoint {ws}/huge_tp --tp 2", "lists ranks 0, 1 but tp 1000000000000000000 x pp 1 needs ranks"),
        ("--checkpoint {ws}/truncated --tp 2", "corrupt or truncated"),
        ("--quant_head", "--quant_head quantizes the LM head too; it needs --quant int8_weight_only"),
        ("--quant int4", "argument --quant: invalid choice: 'int4'"),
    ]),
    *cases(SHARD, "out/", [
        ("--tp 3", "--tp 3 does not divide"),
        ("--pp 5", "--pp 5 is larger than the model's 2 layers"),
        ("--checkpoint {ws}/sharded", "is already a sharded folder; give the HuggingFace folder"),
        ("--checkpoint {ws}/missing", "checkpoint folder not found"),
        ("--checkpoint {ws}/noweights", "model.safetensors"),
        ("--checkpoint {ws}/badckpt", "config.json is not valid JSON"),
        ("--pp x", "argument --pp: invalid int value: 'x'"),
    ]),
    *cases(SHARD.replace("{out}", ""), "", [
        ("{userfile}", "exists and is not a folder"),
        ("{taken}", "which syntorch did not write; move it away"),
        ("{earlier}", "pass --force to replace them"),
    ]),
]
FORCE = {"infer", "trace", "export", "train", "predict", "shard"}  # the commands with --force, added when an earlier run is there


def run_case(case: Case, variant: str, ws: Path, case_dir: Path, capsys, entry=main, prog=None):
    places = {name: str(path) for name, path in prepare(case_dir).items()}
    out = case_dir / case.output.rstrip("/")
    argv = shlex.split(case.argv.format(ws=ws, out=out, case=case_dir, **places))
    if variant == "existing":  # the output is there before: a user's file, or an earlier run's folder and --force
        if case.output.endswith("/"):
            earlier_run(out)
            argv += ["--force"] if argv[0] in FORCE and "{earlier}" not in case.argv else []
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(USER_BYTES)
    refused(argv, case.message.format(ws=ws, case=case_dir), case_dir, capsys, entry, prog)


VARIANTS = [pytest.param(case, variant, id=f"{variant}: {case.id()}")
            for case in CASES for variant in (("absent", "existing") if case.output else ("none",))]


@pytest.mark.parametrize("case, variant", VARIANTS)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, variant, ws, case_dir, capsys):
    run_case(case, variant, ws, case_dir, capsys)


@pytest.mark.parametrize("case", [c for c in CASES if c.argv.startswith("train ")], ids=Case.id)
def test_python_m_syntorch_train_refuses_alike(case, ws, case_dir, capsys):
    """`python -m syntorch.train` (torchrun's entry) has its own parser, with the same options and checks."""
    module_case = Case(case.argv.removeprefix("train "), case.message, case.output, case.name)
    run_case(module_case, "absent", ws, case_dir, capsys, train_module_main, "python -m syntorch.train")


# ---- every number option, found by walking the parsers ------------------------------------------------

def options(parser: Parser, kind) -> list[str]:
    """Every option string (each spelling of each option) of type `kind`."""
    return [s for a in parser._actions if a.type is kind for s in a.option_strings]


def commands() -> dict[str, Parser]:
    sub = next(a for a in build_parser()._actions if a.choices and "infer" in a.choices)
    return dict(sub.choices)


def module_parser() -> Parser:
    parser = Parser(prog="python -m syntorch.train")
    train_arguments(parser)
    return parser


FLOATS = [(command, flag) for command, parser in commands().items() for flag in options(parser, float)]


def test_the_walk_finds_every_float_option():
    assert set(FLOATS) >= {("calibrate", "--seconds"), ("infer", "--temperature"), ("infer", "--top_p"),
                           ("trace", "--bucket_mb"), ("train", "--learning-rate"), ("train", "--eval-fraction")}
    assert options(module_parser(), float) == options(commands()["train"], float)


@pytest.mark.parametrize("value", ["nan", "inf", "=-inf", "1e999"])
@pytest.mark.parametrize("command, flag", FLOATS)
def test_every_float_option_refuses_nan_and_infinity(command, flag, value, case_dir, capsys):
    """Alone on the command line, so a missing check shows as a different error, never as a run (a NaN
    --seconds never ended)."""
    argv = [command, f"{flag}{value}" if value.startswith("=") else flag, *([] if value.startswith("=") else [value])]
    refused(argv, f"{flag} must be a finite number, got", case_dir, capsys)
    if command == "train":
        refused(argv[1:], f"{flag} must be a finite number, got", case_dir, capsys, train_module_main,
                "python -m syntorch.train")


# int options whose 0 means something: everything else must refuse 0; -1 and 2**63 (beyond torch's int64,
# an OverflowError deep inside before) are refused everywhere
ZERO_MEANS_SOMETHING = {
    "infer": {"--top_k", "--seed", "--comm_debug"},  # top_k 0: off; comm_debug 0: counts only
    "trace": {"--zero"},  # DDP
    "train": {"--zero", "--max-steps", "--warmup-steps", "--save-steps", "--eval-steps", "--seed",
              "--trace-wait-steps"},  # zero 0: DDP; else 0: none, or "at the end"
    "convert": {"--rank"},
    "comm": {"--noise_level"},
    "plan": {"--emit"},  # no traces
}
RUNNABLE = {"infer": INFER, "trace": TRACE, "train": TRAIN, "comm": COMM, "shard": SHARD, "plan": PLAN,
            "convert": CONVERT.replace("{out}", "{case}/gpt2.0.et")}
INTS = [(command, flag, value) for command, parser in commands().items() for flag in options(parser, int)
        for value in ("-1", "0", str(2**63)) if value != "0" or flag not in ZERO_MEANS_SOMETHING.get(command, ())]


def test_the_walk_finds_every_int_option():
    found = {(command, flag) for command, flag, _ in INTS}
    assert {("infer", "--batch_size"), ("infer", "--beam_width"), ("trace", "--microbatches"),
            ("trace", "--world_size"), ("train", "--trace-active-steps"), ("train", "--num-gpus")} <= found
    assert all((command, flag) in found for command, flags in ZERO_MEANS_SOMETHING.items() for flag in flags)
    assert {command for command, _ in found} <= set(RUNNABLE)


@pytest.mark.parametrize("command, flag, value", INTS)
def test_every_int_option_refuses_what_means_nothing(command, flag, value, ws, case_dir, capsys):
    argv = shlex.split(RUNNABLE[command].format(ws=ws, out=case_dir / "out", case=case_dir)) + [flag, value]
    refused(argv, flag, case_dir, capsys)


# ---- validate against mutated traces --------------------------------------------------------------------

FUZZ_SEED, FUZZ_RUNS = 17, 300
PER_RUN_S = 10  # a hang becomes a failure; a run takes milliseconds


def messages(data: bytes) -> list[bytes]:
    """The length-delimited messages of a valid .et, each with its length prefix."""
    out, pos = [], 0
    while pos < len(data):
        size, shift, start = 0, 0, pos
        while True:
            byte = data[pos]
            size |= (byte & 0x7F) << shift
            pos, shift = pos + 1, shift + 7
            if not byte & 0x80:
                break
        out.append(data[start:pos + size])
        pos += size
    return out


def mutate(rng: random.Random, data: bytes, other: bytes) -> bytes:
    """One random change: bits flipped, a byte set, cut short, garbage inserted, a message duplicated,
    dropped, swapped with another, or taken from another rank's file."""
    b, kind = bytearray(data), rng.randrange(8)
    if not b or kind == 0:
        for _ in range(rng.randint(1, 4)):
            if b:
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == 1:
        b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 2:
        del b[rng.randrange(len(b)):]
    elif kind == 3:
        at = rng.randrange(len(b) + 1)
        b[at:at] = rng.randbytes(rng.randint(1, 16))
    else:
        try:
            m, theirs = messages(bytes(b)), messages(other)
        except IndexError:  # an earlier mutation left it unparseable: flip a bit instead
            return mutate(rng, data, other) if kind else bytes(b)
        i, j = rng.randrange(len(m)), rng.randrange(len(m))
        if kind == 4:
            m.insert(j, m[i])
        elif kind == 5:
            del m[i]
        elif kind == 6:
            m[i], m[j] = m[j], m[i]
        else:
            m.insert(j, rng.choice(theirs))
        b = bytearray(b"".join(m))
    return bytes(b)


def _too_slow(signum, frame):
    raise TimeoutError(f"a command ran over {PER_RUN_S} s on a mutated trace")


def fuzz(tmp_path, capsys, command: list[str], runs: int) -> dict[int, int]:
    """Runs `command` + [the traces folder] on `runs` seeded mutations of a 4-rank TP x PP trace; checks
    each answer: a one-line error (2), or 0/1 with nothing on stderr; never a traceback, never a hang.
    Returns how often each exit code came."""
    traces = tmp_path / "mix"
    write_chakra({r: tp_pp_rank(r) for r in range(4)}, traces)
    files = sorted(traces.glob("*.et"))
    original = {f: f.read_bytes() for f in files}
    rng, seen = random.Random(FUZZ_SEED), {0: 0, 1: 0, 2: 0}
    previous = signal.signal(signal.SIGALRM, _too_slow)
    try:
        for run in range(runs):
            for f in files:
                f.write_bytes(original[f])
            for _ in range(rng.randint(1, 3)):
                f, other = rng.sample(files, 2)
                f.write_bytes(mutate(rng, f.read_bytes(), original[other]))
            signal.alarm(PER_RUN_S)
            code = main([*command, str(traces)])
            signal.alarm(0)
            out, err = capsys.readouterr()
            assert "Traceback" not in out + err, (run, err)
            if code == 2:
                assert out == "" and len(err.splitlines()) == 1 and err.startswith(f"syntorch {command[0]}: error: "), err
            else:
                assert code in (0, 1) and err == "", (run, code, err)
            seen[code] += 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return seen


def test_validate_answers_every_mutated_trace_cleanly(tmp_path, capsys):
    """validate lists problems (exit 1), finds none (0), or says in one line that a file is corrupt (2)."""
    start = time.monotonic()
    seen = fuzz(tmp_path, capsys, ["validate"], FUZZ_RUNS)
    assert all(seen.values()), f"the mutations should reach every outcome: {seen}"
    assert time.monotonic() - start < 60, "validate should take milliseconds per trace"


@pytest.mark.parametrize("hw", [[], ["--hw_config", "h100-sxm"]], ids=["file durations", "h100-sxm"])
def test_predict_answers_every_mutated_trace_cleanly(tmp_path, capsys, hw):
    """predict simulates what the validator passes and refuses the rest in one line (was: IndexError,
    KeyError: 'dtype', loops forever on a cycle)."""
    seen = fuzz(tmp_path, capsys, ["predict", "--out", str(tmp_path / "p"), "--force", *hw], FUZZ_RUNS // 3)
    assert seen[0] and seen[2] and not seen[1], seen
