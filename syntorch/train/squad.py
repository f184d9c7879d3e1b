"""SQuAD (v1.1/v2.0 JSON) as pretraining text: causal LM on question + context for GPT-2, masked LM on
`[CLS] question [SEP] context [SEP]` for BERT. Tokenizers are local HuggingFace folders; nothing is
downloaded."""
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from syntorch.errors import UserError
from syntorch.userfiles import read_json

IGNORE = -100  # label of positions the loss skips (padding, unmasked MLM tokens), as in torch's cross_entropy
MLM_PROBABILITY = 0.15  # Devlin et al. 2019: 15% of tokens are predicted; of those 80% [MASK], 10% random, 10% kept


def load_squad(path) -> list[tuple[str, str]]:
    """(question, context) pairs from a SQuAD JSON file. v2.0's unanswerable questions are kept: for
    pretraining only the text matters."""
    if not Path(path).is_file():
        raise UserError(f"data file not found: {path}; give --data a SQuAD v1.1/v2.0 JSON file")
    squad = read_json(path, "data file")
    if not isinstance(squad, dict) or not isinstance(squad.get("data"), list):
        raise UserError(f"data file {path} is not SQuAD JSON: expected {{\"data\": [{{\"paragraphs\": ...}}]}}")
    pairs = []
    for i, article in enumerate(squad["data"]):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            raise UserError(f"data file {path}: data[{i}] has no 'paragraphs' list")
        for j, par in enumerate(paragraphs):
            where = f"data[{i}].paragraphs[{j}]"
            if not isinstance(par, dict) or not isinstance(par.get("context"), str) or not isinstance(par.get("qas"), list):
                raise UserError(f"data file {path}: {where} needs a 'context' string and a 'qas' list")
            for k, qa in enumerate(par["qas"]):
                if not isinstance(qa, dict) or not isinstance(qa.get("question"), str):
                    raise UserError(f"data file {path}: {where}.qas[{k}] has no 'question' string")
                pairs.append((qa["question"], par["context"]))
    if not pairs:
        raise UserError(f"data file {path} holds no questions")
    return pairs


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
                   "merges.txt")
# special tokens by role, and the names they have in the GPT-2 and BERT vocabularies when no config names them
ROLES = {"cls": ("[CLS]",), "sep": ("[SEP]",), "mask": ("[MASK]",), "pad": ("[PAD]",), "eos": ("<|endoftext|>", "[EOS]")}


class LocalTokenizer:
    """A local HuggingFace tokenizer folder read with the `tokenizers` library (no transformers import,
    which costs seconds per rank): tokenizer.json, or BERT's vocab.txt, or GPT-2's vocab.json + merges.txt;
    special tokens from special_tokens_map.json / tokenizer_config.json, else their usual names."""

    def __init__(self, folder):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise UserError(f"tokenizer folder not found: {folder}; give --tokenizer a local HuggingFace tokenizer folder")
        config = {**_json_or_empty(self.folder / "tokenizer_config.json"),
                  **_json_or_empty(self.folder / "special_tokens_map.json")}
        self.backend = self._backend(config)
        self.ids = {role: self._special_id(config.get(f"{role}_token"), names) for role, names in ROLES.items()}

    def _backend(self, config: dict):
        import tokenizers

        f = self.folder
        try:
            if (f / "tokenizer.json").is_file():
                return tokenizers.Tokenizer.from_file(str(f / "tokenizer.json"))
            if (f / "vocab.txt").is_file():
                return tokenizers.BertWordPieceTokenizer(str(f / "vocab.txt"), lowercase=config.get("do_lower_case", True))
            if (f / "vocab.json").is_file() and (f / "merges.txt").is_file():
                return tokenizers.ByteLevelBPETokenizer(str(f / "vocab.json"), str(f / "merges.txt"))
        except Exception as e:  # the Rust library raises its own exception types
            raise UserError(f"cannot load the tokenizer in {f}: {str(e).splitlines()[0]}") from None
        raise UserError(f"{f} holds no tokenizer.json, vocab.txt or vocab.json + merges.txt")

    def _special_id(self, configured, names) -> int | None:
        token = configured.get("content") if isinstance(configured, dict) else configured
        for name in [token] if token else names:
            if (i := self.backend.token_to_id(name)) is not None:
                return i
        return None

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def tokens(self, ids) -> list[str]:
        return [self.backend.id_to_token(i) for i in ids]

    def save(self, folder) -> None:
        """Copies the tokenizer's files beside a checkpoint, so the checkpoint folder is complete."""
        for name in TOKENIZER_FILES:
            if (self.folder / name).is_file():
                shutil.copyfile(self.folder / name, Path(folder) / name)


def _json_or_empty(path: Path) -> dict:
    value = read_json(path, "tokenizer file") if path.is_file() else {}
    return value if isinstance(value, dict) else {}


def special_ids(tokenizer: LocalTokenizer, family: str) -> dict:
    """Token ids the objective needs; BERT needs [CLS], [SEP], [MASK] and a pad token."""
    ids = dict(tokenizer.ids)
    if family == "bert":
        missing = [k for k in ("cls", "sep", "mask", "pad") if ids[k] is None]
        if missing:
            raise UserError(f"tokenizer has no {'/'.join(missing)} token; masked LM needs [CLS], [SEP], [MASK] and [PAD]")
    elif ids["pad"] is None:  # GPT-2 has no pad token; padding is never a label, so eos (or 0) serves
        ids["pad"] = ids["eos"] if ids["eos"] is not None else 0
    return ids


def _tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    unique = list(dict.fromkeys(texts))  # SQuAD repeats each context for every question
    ids = tokenizer.encode(unique)
    table = dict(zip(unique, ids))
    return [table[t] for t in texts]


def encode_causal(pairs, tokenizer, max_len: int, eos: int | None) -> list[torch.Tensor]:
    """question + context (+ eos), cut to max_len tokens."""
    tail = [eos] if eos is not None else []
    ids = _tokenize(tokenizer, [f"{q} {c}" for q, c in pairs])
    return [torch.tensor((x + tail)[:max_len]) for x in ids if x]


def encode_masked(pairs, tokenizer, max_len: int, ids: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, segment ids) of [CLS] question [SEP] context [SEP]; the context is cut to fit."""
    questions = _tokenize(tokenizer, [q for q, _ in pairs])
    contexts = _tokenize(tokenizer, [c for _, c in pairs])
    out = []
    for q, c in zip(questions, contexts):
        q = q[:max(1, max_len // 2 - 2)]
        c = c[:max(0, max_len - len(q) - 3)]
        tokens = [ids["cls"], *q, ids["sep"], *c, ids["sep"]]
        out.append((torch.tensor(tokens), torch.tensor([0] * (len(q) + 2) + [1] * (len(c) + 1))))
    return out


def mask_tokens(tokens: torch.Tensor, maskable: torch.Tensor, mask_id: int, vocab_size: int,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: (inputs, labels). 15% of the maskable positions become labels; of those 80% are
    replaced by [MASK], 10% by a random token, 10% kept. Labels elsewhere are IGNORE."""
    def draw(p, where):
        return (torch.rand(tokens.shape, generator=generator) < p) & where

    chosen = draw(MLM_PROBABILITY, maskable)
    labels = torch.where(chosen, tokens, IGNORE)
    masked = draw(0.8, chosen)
    randomized = draw(0.5, chosen & ~masked)  # half of the remaining 20%
    inputs = torch.where(masked, mask_id, tokens)
    random_tokens = torch.randint(vocab_size, tokens.shape, generator=generator)
    return torch.where(randomized, random_tokens, inputs), labels


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T]: the target of each position (causal: shifted by the loss), or IGNORE
    token_types: torch.Tensor | None = None  # [B, T] BERT segments
    attention_mask: torch.Tensor | None = None  # [B, T] 1 for real tokens

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device) if t is not None else None for t in
                       (self.tokens, self.labels, self.token_types, self.attention_mask)))


def _pad(seqs: list[torch.Tensor], value: int) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=value)


class CausalCollate:
    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, seqs: list[torch.Tensor]) -> Batch:
        return Batch(_pad(seqs, self.pad_id), _pad(seqs, IGNORE))


class MaskedCollate:
    """Pads and masks each batch anew (dynamic masking), from its own seeded generator."""

    def __init__(self, ids: dict, vocab_size: int, seed: int):
        self.ids, self.vocab_size = ids, vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, items) -> Batch:
        tokens = _pad([t for t, _ in items], self.ids["pad"])
        types = _pad([s for _, s in items], 0)
        real = _pad([torch.ones_like(t) for t, _ in items], 0)
        maskable = real.bool() & (tokens != self.ids["cls"]) & (tokens != self.ids["sep"])
        inputs, labels = mask_tokens(tokens, maskable, self.ids["mask"], self.vocab_size, self.generator)
        return Batch(inputs, labels, types, real)
