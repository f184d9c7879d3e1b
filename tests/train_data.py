"""What the training tests make for themselves: a word-level tokenizer trained on their own text (saved as a
HuggingFace tokenizer folder), a tiny SQuAD v2.0 file and tiny checkpoints."""
import json
import random

import torch
import transformers as hf
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from conftest import tiny_config
from syntorch.checkpoints import save_checkpoint
from syntorch.models import build_model

WORDS = "the cat sat on a mat dog ran to park bird flew over tree red blue green house".split()
SPECIALS = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                eos_token="[EOS]")


def sentence(rng, n):
    # a repeating pattern with noise, so a tiny model can learn it in a few steps
    start = rng.randrange(len(WORDS))
    return " ".join(WORDS[(start + i) % len(WORDS)] if rng.random() < 0.9 else rng.choice(WORDS) for i in range(n))


def make_squad(path, articles=6, paragraphs=2, questions=4, seed=0):
    rng = random.Random(seed)
    data = [{"title": f"t{a}", "paragraphs": [
        {"context": sentence(rng, 24), "qas": [
            {"id": f"{a}-{p}-{q}", "question": sentence(rng, 5) + " ?", "answers": [], "is_impossible": True}
            for q in range(questions)]} for p in range(paragraphs)]} for a in range(articles)]
    path.write_text(json.dumps({"version": "v2.0", "data": data}))
    return path


def make_tokenizer(folder):
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS) + " ?"], trainers.WordLevelTrainer(special_tokens=list(SPECIALS.values())))
    hf.PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIALS).save_pretrained(str(folder))
    return folder


def make_model(folder, base):
    torch.manual_seed(0)
    save_checkpoint(build_model(tiny_config(base)), folder)
    return folder
