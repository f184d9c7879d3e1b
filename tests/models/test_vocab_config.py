"""A vocabulary size from --model_config (GPT-3's padded 51,200) reaches the traced embedding and head."""
import json

from conftest import tiny_config

from syntorch.chakra.reader import read_trace
from syntorch.cli import main
from syntorch.config import save_model_config


def test_vocab_size_from_model_config_shapes_the_embedding_and_the_head(tmp_path):
    path = tmp_path / "vocab.json"
    save_model_config(tiny_config("gpt2", n_layer=2, vocab_size=51200), path)
    out = tmp_path / "run"
    assert main(["trace", "--model_config", str(path), "--tp", "2", "--pp", "2", "--seq", "16", "--trace_level", "op",
                 "--out", str(out), "--no_progress"]) == 0
    first, last = (read_trace(out / f"tiny-gpt2.{rank}.et")[1] for rank in (0, 2))
    shapes = {n.name: (n.inputs.shapes, n.outputs.shapes) for n in first + last}
    # each TP rank's half of the 51,200 rows (already a multiple of 128·tp); the loss reads them vocab-parallel
    assert shapes["tok_emb:aten.embedding"][0].startswith("[[25600,64]")
    assert shapes["loss:aten.amax"] == ("[[16,25600]]", "[[16]]")
    assert shapes["loss:aten.exp_"] == ("[[16,25600]]", "[[16,25600]]")
    assert "lm_head:aten.cat" not in shapes  # no gather of the logits
    summary = json.loads((out / "summary.json").read_text())
    # the first stage holds its half of the embedding, in the trace's default bf16
    assert summary["stages"][0]["memory_bytes"]["weights"] >= 25600 * 64 * 2
