"""`syntorch infer` end to end (its bad inputs are in test_bad_inputs.py)."""
import json

import pytest

from syntorch.cli import main


def run_cli(tmp_path, *argv):
    out = tmp_path / "out"
    code = main(["infer", "--out", str(out), *argv])
    return code, out


def tiny_hf_gpt2(tmp_path):
    """A tiny random GPT-2 checkpoint and a word-level tokenizer for it, both saved as HF folders."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    words = "the cat sat on a mat and dog ran to it".split()
    vocab = {w: i for i, w in enumerate(["[UNK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path / "tok")
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=64, n_embd=32, n_layer=2, n_head=4)).eval()
    hf.save_pretrained(tmp_path / "ckpt")
    return hf, tmp_path / "ckpt", tmp_path / "tok"


def test_checkpoint_prompt_greedy_matches_hf(tmp_path, capsys):
    import torch
    hf, ckpt, tok = tiny_hf_gpt2(tmp_path)
    code, out = run_cli(tmp_path, "--checkpoint", str(ckpt), "--tokenizer", str(tok), "--prompt", "the cat sat",
                        "--num_output_tokens", "6", "--temperature", "0")
    assert code == 0, capsys.readouterr().err
    record = json.loads((out / "run.json").read_text())
    prompt = record["input_ids"][0]
    assert prompt == [1, 2, 3]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0].tolist()
    assert record["output_ids"][0] == expected
    assert isinstance(record["output_text"][0], str) and record["output_text"][0].startswith("the cat sat")
    for key in ("model", "device", "dtype", "tp", "prefill_ms", "decode_ms_per_token", "tokens_per_s"):
        assert key in record
    assert record["prefill_ms"] > 0 and record["tokens_per_s"] > 0
    assert record["model"] == "ckpt"  # named after its folder


@pytest.mark.parametrize("hw", [None, "h100-sxm"])
def test_symbolic_run_reports_a_prediction_not_the_tracers_speed(tmp_path, capsys, hw):
    code, out = run_cli(tmp_path, "--model", "gpt2", "--device", "meta", "--num_input_tokens", "8",
                        "--num_output_tokens", "3", *(["--hw_config", hw] if hw else []))
    assert code == 0
    record = json.loads((out / "run.json").read_text())
    assert record["symbolic"] and record["output_tokens_traced"] == 3
    assert not {"output_ids", "prefill_ms", "decode_ms_per_token", "tokens_per_s"} & set(record)
    printed = capsys.readouterr().out
    assert "tokens/s" not in printed and "generated" not in printed
    if hw:
        predicted = record["predicted"]  # the simulated run: prefill, then 2 decode steps (3 tokens)
        assert f"predicted latency {predicted['latency_ms']:.1f} ms on h100-sxm" in printed
        assert predicted["prefill_ms"] + 2 * predicted["decode_ms_per_token"] == pytest.approx(predicted["latency_ms"])
        assert 0 < predicted["prefill_ms"] < predicted["latency_ms"]
        assert "predicted_latency_us" not in record["trace"]  # one prediction: the simulator's
        assert (out / "timeline.json").is_file()
    else:
        assert "give --hw_config for a predicted latency" in printed


def test_model_config_run_is_reproducible_with_seed(tmp_path):
    cfg = tmp_path / "m.json"
    cfg.write_text(json.dumps({"base": "gpt3-125m", "n_layer": 1, "d_model": 64, "n_head": 4, "vocab_size": 100}))
    args = ["--model_config", str(cfg), "--num_input_tokens", "5", "--num_output_tokens", "4", "--batch_size", "2"]
    runs = []
    for name in ("a", "b"):
        assert main(["infer", "--out", str(tmp_path / name), *args, "--seed", "7"]) == 0
        runs.append(json.loads((tmp_path / name / "run.json").read_text()))
    assert runs[0]["output_ids"] == runs[1]["output_ids"]
    assert len(runs[0]["output_ids"]) == 2 and all(len(s) == 9 for s in runs[0]["output_ids"])
    assert runs[0]["model_config"]["n_layer"] == 1


def test_seed_example_script_runs_verbatim(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "examples" / "gpt3" / "inference.py"
    cfg = tmp_path / "m.json"
    cfg.write_text(json.dumps({"base": "gpt3-125m", "n_layer": 1, "d_model": 64, "n_head": 4}))
    work = tmp_path / "work"  # outputs go to the current folder, which must hold nothing of the user's
    work.mkdir()
    proc = subprocess.run([sys.executable, str(script), "--num_input_tokens", "10", "--num_output_tokens", "20",
                           "--tp", "1", "--device", "cpu", "--model_config", str(cfg)],
                          cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((work / "run.json").read_text())
    assert len(record["input_ids"][0]) == 10 and len(record["output_ids"][0]) == 30
