"""Ragged batches: prompts of different lengths, left-padded into one batch, generate what each generates
alone (greedy, beam, seeded sampling; GPT-2 and GPT-J), stop tokens end rows separately, and the CLI takes
several prompts (--input_ids repeated, --prompt_file) and records each row without padding; an encoder's
right-padded rows predict what each predicts alone."""
import json

import pytest
import torch

from conftest import tiny_config
from syntorch.errors import UserError
from syntorch.generate import Sampling, generate, left_pad
from syntorch.fill_mask import predict_masked
from syntorch.inference import InferenceSpec, make_prompt, run_inference
from syntorch.models import build_model

ROWS = [[5, 6, 7, 8, 9, 10], [3, 4], [11, 12, 13, 14]]
GREEDY = Sampling(temperature=0)


@pytest.fixture(scope="module", params=["gpt2", "gptj-6b"])
def model(request):
    torch.manual_seed(0)
    model = build_model(tiny_config(request.param)).eval()
    with torch.no_grad():  # wide weights: peaked distributions, varied tokens, no near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(15)
    return model


def test_left_pad():
    ids, pads = left_pad([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and pads == [0, 2]


@pytest.mark.parametrize("kwargs", [dict(sampling=GREEDY), dict(sampling=GREEDY, beam_width=3),
                                    dict(sampling=Sampling(temperature=0.8, top_k=20, seed=3))],
                         ids=["greedy", "beam", "sampled"])
def test_each_row_generates_what_it_generates_alone(model, kwargs):
    prompt, pads = left_pad(ROWS)
    batch = generate(model, prompt, 8, pads=pads, **kwargs)
    if kwargs["sampling"].greedy:
        alone = [generate(model, torch.tensor([row]), 8, **kwargs).tokens[0] for row in ROWS]
        assert batch.tokens == alone
    assert [t[:len(r)] for t, r in zip(batch.tokens, ROWS)] == ROWS  # no padding in the result
    assert batch.prompt_lens == [len(r) for r in ROWS] and all(len(n) == 8 for n in batch.new_tokens)


def test_stop_tokens_end_rows_separately(model):
    prompt, pads = left_pad(ROWS)
    free = generate(model, prompt, 8, GREEDY, pads=pads).new_tokens
    stop = free[1][2]  # row 1's third new token
    stopped = generate(model, prompt, 8, GREEDY, pads=pads, stop_tokens=[stop]).new_tokens
    for row, new in zip(free, stopped):
        cut = row.index(stop) + 1 if stop in row else len(row)
        assert new == row[:cut]
    assert len(stopped[1]) == 3


def test_padding_must_fit_the_rows(model):
    with pytest.raises(UserError, match="pads must give"):
        generate(model, torch.tensor([[1, 2]]), 2, GREEDY, pads=[2])


def test_cli_spec_takes_several_prompts_and_records_rows_without_padding(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny_config("gpt2").to_dict()))
    record = run_inference(InferenceSpec(model_config=str(config), input_ids=ROWS, num_output_tokens=4,
                                         temperature=0), tmp_path / "out")
    assert record["input_ids"] == ROWS and record["batch_size"] == 3
    assert [ids[:len(r)] for ids, r in zip(record["output_ids"], ROWS)] == ROWS
    assert [len(ids) - len(r) for ids, r in zip(record["output_ids"], ROWS)] == [4, 4, 4]


@pytest.mark.parametrize("mask", [None, 103], ids=["every-position", "masked"])
def test_an_encoder_predicts_each_row_as_alone(mask):
    """BERT's prompts of different lengths, right-padded with an attention mask: each row's predictions
    (positions, top ids, probabilities) are those of the row run alone."""
    torch.manual_seed(0)
    model = build_model(tiny_config("bert-base-uncased", vocab_size=128, mask_token_id=103)).eval()
    rows = [[1, 5, 6, 7, 8, 2], [1, 9, 2], [1, 11, 12, 13, 2]]
    if mask is not None:
        rows = [r[:2] + [mask] + r[3:] for r in rows]
    spec = InferenceSpec(model="bert-base-uncased", input_ids=rows)
    config = tiny_config("bert-base-uncased", vocab_size=128, mask_token_id=103)
    prompt = make_prompt(spec, config)
    assert prompt.rows == rows and prompt.ids[1].tolist() == rows[1] + [0, 0, 0]  # right-padded
    batch = predict_masked(model, prompt.ids, 103, lengths=[len(r) for r in rows])
    for b, row in enumerate(rows):
        alone = predict_masked(model, torch.tensor([row]), 103)
        assert batch.positions[b] == alone.positions[0] and batch.top_ids[b] == alone.top_ids[0]
        torch.testing.assert_close(torch.tensor(batch.top_probs[b]), torch.tensor(alone.top_probs[0]))
