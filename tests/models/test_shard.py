"""`syntorch shard` and per-rank loading, against transformers' own models and the full (unsharded) load.

- A tiny GPT-2 made and saved by transformers, sharded for TP 2, generates under 2 gloo ranks exactly the greedy
  tokens of transformers' generate; given the HF folder directly, each rank reads the same tensors its file holds.
- TP 2 x PP 2 files hold what each rank owns: the stage's layers only (first stage the embeddings, last the
  final norm and the head), each tensor cut as apply_tp cuts the full one; one tensor is checked by hand
  against the HF weight it comes from. GPT-J (q, k, v fused from three HF tensors, untied head) too.
- Bad index, missing or truncated rank files are one-line UserErrors.
"""
import json

import pytest
import torch
import transformers

from syntorch.checkpoints import SHARD_INDEX, check_shard_layout, load_checkpoint, read_shard_index
from syntorch.errors import UserError
from syntorch.inference import InferenceSpec, run_inference
from syntorch.parallel.distributed import symbolic_world
from syntorch.parallel.mesh import Mesh, init_groups
from syntorch.parallel.tensor import padded_vocab, plan_for, take_shard
from syntorch.quant import quantize_int8_weight_only
from syntorch.shard_files import load_rank_model, stage_model, stages, write_shards

PROMPT = [5, 17, 42, 7, 99, 3]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=200, n_positions=64,
                                     initializer_range=0.3)  # logits far from flat: greedy ties cannot flip
    folder = tmp_path_factory.mktemp("hf") / "gpt2"
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gptj_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=150, n_positions=64)
    folder = tmp_path_factory.mktemp("hf") / "gptj"
    transformers.GPTJForCausalLM(config).eval().save_pretrained(folder)
    return folder


def hf_greedy(folder, new_tokens: int) -> list[int]:
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    ids = torch.tensor([PROMPT])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                      pad_token_id=0, eos_token_id=None)
    return out[0].tolist()


def infer(checkpoint, out, tp: int, new_tokens: int) -> list[int]:
    spec = InferenceSpec(checkpoint=str(checkpoint), tp=tp, temperature=0, input_ids=PROMPT,
                         num_output_tokens=new_tokens)
    return run_inference(spec, out)["output_ids"][0]


def test_sharded_tp2_generates_transformers_greedy_tokens(gpt2_dir, tmp_path):
    write_shards(gpt2_dir, tmp_path / "tp2", tp=2, pp=1)
    want = hf_greedy(gpt2_dir, 12)
    assert infer(tmp_path / "tp2", tmp_path / "a", 2, 12) == want  # 2 spawned gloo ranks, each reading its file
    assert infer(gpt2_dir, tmp_path / "c", 1, 12) == want


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_reading_the_hf_folder_gets_its_shard_files_tensors(rank, gpt2_dir, tmp_path):
    """The HF folder given directly: the rank's slices read lazily through apply_tp's plan equal its file."""
    write_shards(gpt2_dir, tmp_path / "tp2", tp=2, pp=1)
    config = load_checkpoint(gpt2_dir)[0]
    with symbolic_world(rank, 2):
        from_hf = load_rank_model(config, gpt2_dir, "cpu", torch.float32, init_groups(Mesh(tp=2))).state_dict()
        from_file = load_rank_model(config, tmp_path / "tp2", "cpu", torch.float32, init_groups(Mesh(tp=2)))
    want = read_rank(tmp_path / "tp2", rank)
    assert set(want) <= set(from_hf) and all(torch.equal(from_hf[n], t) for n, t in want.items())
    assert from_file.lm_head.weight is from_file.tok_emb.weight  # tied again after loading


def expected_rank_tensors(folder, tp: int, pp: int) -> dict[int, dict[str, torch.Tensor]]:
    """Each rank's tensors cut from the fully loaded model with the TP code's own take_shard."""
    config, full = load_checkpoint(folder)
    state = full.state_dict()
    out = {}
    for stage in stages(config, pp):
        model = stage_model(config, stage)
        styles = plan_for(model, sequence_parallel=False)
        names = {n for n, _ in model.named_parameters()}  # a tied head once, as the embedding where both live
        for r in range(tp):
            out[stage.index * tp + r] = {
                n: take_shard(styles.get(n.rpartition(".")[0], "replicated"), n.rpartition(".")[2], state[n], r, tp,
                              padded_vocab(config.vocab_size, tp), config.d_head) for n in names}
    return out


def read_rank(folder, rank: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(folder / read_shard_index(folder).files[rank])


@pytest.mark.parametrize("family", ["gpt2", "gptj"])
def test_tp2_pp2_files_hold_each_ranks_slices_of_its_stage(family, gpt2_dir, gptj_dir, tmp_path):
    source = gpt2_dir if family == "gpt2" else gptj_dir
    index = write_shards(source, tmp_path / "s", tp=2, pp=2)
    assert (index.tp, index.pp, sorted(index.files)) == (2, 2, [0, 1, 2, 3])
    expected = expected_rank_tensors(source, 2, 2)
    n_layer = index.config.n_layer
    for rank in range(4):
        got = read_rank(tmp_path / "s", rank)
        assert sorted(got) == sorted(expected[rank]) == index.tensors[rank]
        for name, t in got.items():
            assert torch.equal(t, expected[rank][name]), name
        layers = {int(n.split(".")[1]) for n in got if n.startswith("layers.")}
        first_stage = rank < 2
        assert layers == (set(range(n_layer // 2)) if first_stage else set(range(n_layer // 2, n_layer)))
        assert ("tok_emb.weight" in got) == first_stage and ("lm_head.weight" in got) != first_stage
        assert ("ln_f.weight" in got) != first_stage


@pytest.mark.parametrize("source", ["shard", "hf"])
def test_a_tp2_pp2_rank_loads_its_stage_and_slices(source, gpt2_dir, tmp_path):
    """Rank 3 (stage 1, TP rank 1) of TP 2 x PP 2, as a pipeline-parallel run loads it."""
    write_shards(gpt2_dir, tmp_path / "s", tp=2, pp=2)
    config = load_checkpoint(gpt2_dir)[0]
    with symbolic_world(3, 4):
        model = load_rank_model(config, tmp_path / "s" if source == "shard" else gpt2_dir, "cpu", torch.float32,
                                init_groups(Mesh(tp=2, pp=2)))
    want = read_rank(tmp_path / "s", 3)
    state = model.state_dict()
    assert set(state) == set(want) and all(torch.equal(state[n], t) for n, t in want.items())
    assert model.tok_emb is None and sorted(model.layers) == ["2", "3"]


def test_a_slice_against_the_hf_weight_it_comes_from(gpt2_dir, tmp_path):
    """Rank 1 of TP 2 holds heads 2..3 of q, k and v: columns of HF's Conv1D c_attn [in, 3 * d]."""
    from safetensors.torch import load_file
    write_shards(gpt2_dir, tmp_path / "s", tp=2, pp=1)
    c_attn = load_file(gpt2_dir / "model.safetensors")["transformer.h.1.attn.c_attn.weight"]  # [64, 192]
    want = torch.cat([c_attn[:, j * 64 + 32:(j + 1) * 64] for j in range(3)], 1).t()
    assert torch.equal(read_rank(tmp_path / "s", 1)["layers.1.attn.qkv.weight"], want)
    wte = load_file(gpt2_dir / "model.safetensors")["transformer.wte.weight"]  # vocab 200 padded to 256: rank 1 has 72 + 56 zeros
    emb = read_rank(tmp_path / "s", 1)["tok_emb.weight"]
    assert torch.equal(emb[:72], wte[128:]) and not emb[72:].any()


def test_rank_model_from_a_shard_equals_the_full_load(gptj_dir, tmp_path):
    write_shards(gptj_dir, tmp_path / "s", tp=1, pp=1)
    config, full = load_checkpoint(gptj_dir)
    ours = load_rank_model(config, tmp_path / "s", "cpu", torch.bfloat16)
    x = torch.tensor([PROMPT])
    assert next(ours.parameters()).dtype == torch.bfloat16
    assert torch.allclose(ours(x).float(), full.to(torch.bfloat16)(x).float())


def test_layout_and_rank_file_errors(gpt2_dir, tmp_path):
    folder = tmp_path / "s"
    write_shards(gpt2_dir, folder, tp=2, pp=1)
    with pytest.raises(UserError, match=r"sharded for --tp 2 --pp 1 but this run has --tp 1 --pp 1"):
        check_shard_layout(folder, 1, 1)
    with pytest.raises(UserError, match="already a sharded folder"):
        write_shards(folder, tmp_path / "again", tp=2, pp=1)
    rank1 = folder / read_shard_index(folder).files[1]
    data = rank1.read_bytes()
    rank1.write_bytes(data[:len(data) // 2])
    with pytest.raises(UserError, match="corrupt or truncated"):
        check_shard_layout(folder, 2, 1)
    rank1.unlink()
    with pytest.raises(UserError, match="rank 1's file .* is missing"):
        check_shard_layout(folder, 2, 1)
    index = json.loads((folder / SHARD_INDEX).read_text())
    index["ranks"]["0"]["file"] = "../elsewhere.safetensors"
    (folder / SHARD_INDEX).write_text(json.dumps(index))
    with pytest.raises(UserError, match="rank 0 needs 'file'"):
        read_shard_index(folder)
    assert not (tmp_path / "again").exists()


def test_int8_under_tp_quantizes_each_ranks_own_slice(gpt2_dir, tmp_path):
    """--quant after sharding: rank 1's scales are max|w| / 127 over its own rows (column-parallel qkv) and
    over its own half of every row (row-parallel proj), so each rank's int8 matrix dequantizes to its slice."""
    write_shards(gpt2_dir, tmp_path / "tp2", tp=2, pp=1)
    config = load_checkpoint(gpt2_dir)[0]
    with symbolic_world(1, 2):
        model = load_rank_model(config, tmp_path / "tp2", "cpu", torch.float32, init_groups(Mesh(tp=2)))
    want = read_rank(tmp_path / "tp2", 1)
    quantize_int8_weight_only(model)
    for name in ("layers.0.attn.qkv", "layers.0.attn.proj"):
        full, q = want[f"{name}.weight"], model.get_submodule(name).weight
        assert torch.allclose(q.scale, full.abs().amax(1) / 127)
        deq = torch.tensor(q.tolist(), dtype=torch.float32) * q.scale[:, None]
        assert (deq - full).abs().max() <= q.scale.max() / 2 + 1e-7


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_gqa_and_moe_shards_serve_tp2_and_pp2_with_the_one_process_tokens(family, tmp_path):
    """Llama's grouped-query qkv (8 query heads, 2 K/V heads) and fused [gate; up], and Mixtral's experts, cut
    by the TP plan from a HuggingFace folder: TP 2 and PP 2 from shard files, and TP 2 reading the folder
    lazily, generate what one process does with the whole checkpoint."""
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    model = (transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)) if family == "llama" else
             transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, **common)))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # logits far from flat: greedy ties cannot flip
    model.save_pretrained(tmp_path / "hf")
    want = infer(tmp_path / "hf", tmp_path / "one", 1, 8)
    write_shards(tmp_path / "hf", tmp_path / "tp2", tp=2, pp=1)
    assert infer(tmp_path / "tp2", tmp_path / "a", 2, 8) == want
    assert infer(tmp_path / "hf", tmp_path / "b", 2, 8) == want
    write_shards(tmp_path / "hf", tmp_path / "pp2", tp=1, pp=2)
    spec = InferenceSpec(checkpoint=str(tmp_path / "pp2"), pp=2, temperature=0, input_ids=PROMPT,
                         num_output_tokens=8)
    assert run_inference(spec, tmp_path / "c")["output_ids"][0] == want
