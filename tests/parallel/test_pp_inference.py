"""Pipeline-parallel inference: FasterTransformer's micro-batch rule; real gloo ranks (PP 2 and TP 2 x PP 2)
generate what one process generates (greedy, beam, seeded sampling, a ragged batch) and trace the
collectives the symbolic trace has; symbolic per-rank traces whose sends meet their recvs; the CLI."""
import copy
import json
from collections import Counter

import pytest
import torch

from conftest import tiny_config
from syntorch.chakra.reader import find_traces
from syntorch.chakra.validator import check_traces
from syntorch.errors import UserError
from syntorch.generate import Sampling, generate, left_pad
from syntorch.inference import InferenceSpec, RunOutputs, run_inference
from syntorch.models import build_model
from syntorch.parallel.launch import init_distributed, spawn
from syntorch.parallel.mesh import Mesh, init_groups
from syntorch.parallel.pipeline import split_stage
from syntorch.parallel.pipeline_inference import PipelineForward, chain_group, microbatch_rows, stage_of
from syntorch.parallel.tensor import apply_tp
from syntorch.trace.generation import trace_pp_stage, trace_run

ROWS = [[5, 17, 99, 3, 42, 8], [11, 2], [64, 7, 9], [1, 30, 31, 32, 33]]  # ragged: 4 rows, 2 micro-batches at PP 2
NEW = 5
CHOICES = {"greedy": dict(sampling=Sampling(temperature=0)),
           "beam": dict(sampling=Sampling(temperature=0), beam_width=2),
           "sampled": dict(sampling=Sampling(temperature=0.9, top_k=30, top_p=0.95, seed=11))}


def test_microbatches_follow_fastertransformer():
    assert microbatch_rows(8, 1, 2) == 4  # decode: the batch split into pp micro-batches
    assert microbatch_rows(8, 1, 1) == 8  # no pipeline, no split
    assert microbatch_rows(6, 1, 4) == 6  # does not divide: one micro-batch
    assert microbatch_rows(16, 300, 2) == 2  # prefill: halved while over 1024 tokens and even (8, 4, 2)
    assert microbatch_rows(8, 512, 2) == 2  # 2 x 512 = 1024 is not over the cap
    assert microbatch_rows(3, 2000, 3) == 1


def peaked_model(base):
    """A tiny model with wide weights: peaked next-token distributions, so float reordering cannot flip a
    choice and the tokens are not one repeated id."""
    torch.manual_seed(0)
    model = build_model(tiny_config(base, n_layer=4)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(15)
    return model


def collective_signature(graph):
    return [(d["phase"], d["collective"], d["bytes"], d["group"], d["src"], d["dst"], d["tag"])
            for _, d in graph.collectives()]


def pipeline_rank(out_dir):
    """Per mesh (PP 2 as two data-parallel chains; TP 2 x PP 2), per model and way of choosing: the stage's
    tokens equal one process's; then GPT-2's traced collectives at TP 2 x PP 2 for the parent."""
    rank, world = init_distributed("cpu")
    prompt, pads = left_pad(ROWS)
    for mesh in (Mesh(dp=2, pp=2), Mesh(pp=2, tp=2)):
        groups = init_groups(mesh)
        chain = chain_group(mesh)
        for base in ("gpt2", "gptj-6b"):
            full = peaked_model(base)
            for name, kwargs in CHOICES.items():
                want = generate(full, prompt, NEW, pads=pads, **kwargs).tokens
                model = copy.deepcopy(full)
                if mesh.tp > 1:
                    apply_tp(model, groups.tp)
                split_stage(model, stage_of(groups, model.config.n_layer))
                forward = PipelineForward(groups, chain, model.config.n_layer, kwargs.get("beam_width", 1))
                got = generate(model, prompt, NEW, pads=pads, forward=forward, **kwargs).tokens
                assert got == want, f"{mesh} {base} {name} rank {rank}: {got} != {want}"
    model = peaked_model("gpt2")
    apply_tp(model, groups.tp)
    split_stage(model, stage_of(groups, 4))
    forward = PipelineForward(groups, chain, 4)
    graph, _ = trace_run(model, lambda m, scope: generate(m, prompt, NEW, Sampling(temperature=0), phase_scope=scope,
                                                          pads=pads, forward=forward), rank=rank, world_size=world)
    with open(f"{out_dir}/collectives.rank{rank}.json", "w") as f:
        json.dump(collective_signature(graph), f)


def test_real_ranks_generate_what_one_process_does_and_trace_like_symbolic(tmp_path):
    spawn(pipeline_rank, 4, (str(tmp_path),))
    mesh, config = Mesh(pp=2, tp=2), tiny_config("gpt2", n_layer=4)
    prompt, pads = left_pad(ROWS)
    real = {r: [tuple(c) for c in json.loads((tmp_path / f"collectives.rank{r}.json").read_text())] for r in range(4)}
    for stage in range(2):
        graph, _ = trace_pp_stage(config, lambda m, scope, forward: generate(
            m, prompt.to("meta"), NEW, Sampling(temperature=0), phase_scope=scope, pads=pads, forward=forward), mesh, stage)
        assert [tuple(json.loads(json.dumps(c))) for c in collective_signature(graph)] == real[mesh.representative(stage)]
    # stage 0 sends each micro-batch's stream to the same TP rank of stage 1, which receives it in order
    sends = [(c[4], c[5], c[6]) for c in real[1] if c[1] == "send"]
    recvs = [(c[4], c[5], c[6]) for c in real[3] if c[1] == "recv"]
    assert sends == recvs and {(s, d) for s, d, _ in sends} == {(1, 3)}
    assert len(sends) == 2 * NEW  # 2 micro-batches per step (4 rows at PP 2)
    assert Counter(c[1] for c in real[0])["broadcast"] == NEW  # the chosen tokens, once per step


def symbolic_run(tmp_path, name, **spec):
    outputs = RunOutputs(chakra=True, comm_debug=1)
    return run_inference(InferenceSpec(device="meta", **spec), tmp_path / name, outputs)


def test_symbolic_tp2_pp2_per_rank_traces_pair_every_send_with_its_recv(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny_config("gptj-6b", n_layer=3).to_dict()))
    record = symbolic_run(tmp_path, "run", model_config=str(config), input_ids=ROWS, num_output_tokens=3,
                          tp=2, pp=2, beam_width=2)
    assert record["pp"] == 2 and record["trace"]["ranks"] == 4 and record["trace"]["chakra"]["ranks"] == 4
    folder = tmp_path / "run" / "chakra"
    assert [r for r, _ in find_traces(folder)] == [0, 1, 2, 3]
    problems, ranks, _ = check_traces(folder)
    assert problems == [] and ranks == 4  # the validator's cross-rank rules: every send meets its recv
    first, last = ((tmp_path / "run" / f"{name}.json").read_text() for name in ("comm_debug", "comm_debug_stage1"))
    assert "c10d.send" in first and "c10d.recv_" not in first  # stage 0 sends, stage 1 receives
    assert "c10d.recv_" in last and "c10d.broadcast_" in last


@pytest.mark.parametrize("spec, message", [
    (dict(pp=5), "--pp 5 is larger than the model's 4 layers"),
    (dict(pp=2, sp=True, tp=2), "--sp with --pp"),
    (dict(pp=0), "--pp must be positive"),
])
def test_bad_pipelines_are_one_line(tmp_path, spec, message):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny_config("gpt2", n_layer=4).to_dict()))
    with pytest.raises(UserError, match=message):
        symbolic_run(tmp_path, "bad", model_config=str(config), **spec)
    assert not (tmp_path / "bad").exists()


def test_run_inference_on_real_pipeline_ranks_writes_what_one_rank_does(tmp_path):
    """The command's path: 2 spawned stages, rank 0 writes run.json; tokens as --pp 1 (ragged, greedy)."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny_config("gptj-6b", n_layer=3).to_dict()))
    spec = dict(model_config=str(config), input_ids=ROWS, num_output_tokens=4, temperature=0)
    one = run_inference(InferenceSpec(**spec), tmp_path / "pp1")
    two = run_inference(InferenceSpec(**spec, pp=2), tmp_path / "pp2")
    assert two["output_ids"] == one["output_ids"] and two["pp"] == 2 and two["input_ids"] == ROWS
