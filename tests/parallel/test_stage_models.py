"""Pipeline stages are the models themselves: a stage's model skips the embeddings, layers and head it does not
hold, so stage 0 then stage 1 equals the whole model, for every family, with BERT's mask and token types, and
under TP with sequence parallel on real gloo ranks."""
import copy

import pytest
import torch
from conftest import in_turn, tiny_config

from syntorch.models import build_model
from syntorch.parallel.launch import init_distributed, spawn
from syntorch.parallel.mesh import Mesh, init_groups
from syntorch.parallel.pipeline import Stage, split_stage, stage_forward, stage_layers
from syntorch.parallel.tensor import apply_tp

BASES = ("gpt2", "gptj-6b", "bert-base-uncased")


def stages(full, pp: int, tp_groups=None, sp: bool = False):
    """The `pp` stage models of `full`, each a copy split as apply_plans splits it (TP first, when given)."""
    out = []
    for index, layers in enumerate(stage_layers(full.config.n_layer, pp)):
        model = copy.deepcopy(full)
        if tp_groups is not None:
            apply_tp(model, tp_groups, sp)
        out.append(split_stage(model, Stage(index, pp, layers)))
    return out


def bert_inputs(batch: int, seq: int) -> dict:
    """Two segments and a padded row, so both the mask and the token types change the logits."""
    types = torch.zeros(batch, seq, dtype=torch.long)
    types[:, seq // 2:] = 1
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq - 3:] = 0
    return {"token_type_ids": types, "attention_mask": mask}


def run_stages(models, idx, **inputs):
    x = idx
    for model in models:  # what each stage sends, the next receives
        x = stage_forward(model, x, **inputs)
    return x


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("pp", [2, 3])
def test_stages_in_turn_equal_the_whole_model(base, pp):
    full = build_model(tiny_config(base, n_layer=3))
    idx = torch.randint(0, full.config.vocab_size, (2, 10))
    inputs = bert_inputs(2, 10) if base.startswith("bert") else {}
    first, *later = stages(full, pp)
    with torch.no_grad():
        stream = stage_forward(first, idx, **inputs)
        assert stream.shape == (2, 10, full.config.d_model)  # the first stage sends the residual stream
        torch.testing.assert_close(run_stages(later, stream, **inputs), full(idx, **inputs), rtol=1e-5, atol=1e-5)


def test_bert_stages_keep_the_mask_and_token_types():
    """Without them the last stage's logits would differ: the check above would hold only by accident."""
    full = build_model(tiny_config("bert-base-uncased"))
    idx, inputs = torch.randint(0, 128, (2, 10)), bert_inputs(2, 10)
    with torch.no_grad():
        plain = full(idx)
        assert not torch.allclose(plain, full(idx, token_type_ids=inputs["token_type_ids"]), atol=1e-4)
        assert not torch.allclose(plain, full(idx, attention_mask=inputs["attention_mask"]), atol=1e-4)


def test_stages_hold_only_their_parts():
    first, last = stages(build_model(tiny_config("gpt2", n_layer=4)), 2)
    assert list(first.layers) == ["0", "1"] and list(last.layers) == ["2", "3"]
    assert first.lm_head is None and first.ln_f is None and last.tok_emb is None and last.pos_emb is None


def _tp_stages_rank(base: str):
    """On each of 2 TP ranks: the two stages, TP + SP sharded, in turn equal the whole unsharded model; a later
    stage gets the sequence split in halves and its length (GPT-J's rotary positions come from it); TP reads
    the split from the stream it is given."""
    init_distributed("cpu")
    groups = init_groups(Mesh(tp=2))
    torch.manual_seed(0)
    full = build_model(tiny_config(base, n_layer=3))
    idx = torch.randint(0, full.config.vocab_size, (2, 8))
    inputs = bert_inputs(2, 8) if base.startswith("bert") else {}
    models = stages(full, 2, groups, sp=True)
    with torch.no_grad():
        stream = stage_forward(models[0], idx, **inputs)
        assert stream.shape == (2, 4, full.config.d_model), stream.shape  # split along the sequence
        torch.testing.assert_close(stage_forward(models[1], stream, seq_len=8, **inputs), full(idx, **inputs),
                                   rtol=1e-4, atol=1e-4)


def test_tp_sp_stages_in_turn_equal_the_whole_model():
    """GPT-J and BERT on one launch of 2 ranks, each checked by _tp_stages_rank from seed 0."""
    spawn(in_turn, 2, tuple((_tp_stages_rank, (base,)) for base in ("gptj-6b", "bert-base-uncased")))
