"""Uneven pipeline stages (parallel/layout.py): the cut against Megatron-Core's layer-offset formula, bad
counts refused in one line, symbolic traces of uneven interleaved stages (the layers each stage runs, the
middle stages derived by shifting, a validating workload), and real gloo runs against one process."""
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from plan_steps import microbatches

from syntorch.errors import UserError
from syntorch.parallel.layout import Layout
from syntorch.parallel.pipeline import stage_chunks
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.step_schedule import schedule_stage
from syntorch.trace.training import probe_stage, shift_stage, trace_stage, traced_stage_for


def megatron_offset(n_layer, pp, vp, stage, chunk, layout):
    """Megatron-Core's get_transformer_layer_offset (transformer_layer.py), as written there, with vp given."""
    if layout.first is not None or layout.last is not None:
        first, last = layout.first or 0, layout.last or 0
        middle_stages = pp - (layout.first is not None) - (layout.last is not None)
        first_chunk, last_chunk, middle_chunk = first // vp, last // vp, (n_layer - first - last) // vp
        total = first_chunk + middle_chunk + last_chunk
        if stage == 0:
            return chunk * total
        return chunk * total + first_chunk + (stage - 1) * (middle_chunk // middle_stages)
    total_layers = n_layer + layout.embedding + layout.loss
    per_virtual = total_layers // pp // vp
    offset = chunk * (total_layers // vp) + stage * per_virtual
    return offset - (layout.embedding and not (stage == 0 and chunk == 0))


@pytest.mark.parametrize("n_layer,pp,vp,layout", [
    (12, 4, 2, Layout(first=2, last=2)),
    (10, 3, 2, Layout(first=2)),
    (126, 16, 1, Layout(first=7, last=7)),  # Llama 3 405B, one layer fewer on the first and last stage
    (126, 16, 4, Layout(embedding=True, loss=True)),  # the same counts, interleaved
    (126, 8, 8, Layout(embedding=True, loss=True)),  # NVIDIA's Llama 3.1 405B benchmark layout (PP8, VP8)
    (7, 2, 2, Layout(embedding=True)),
])
def test_chunks_start_where_megatron_core_puts_them(n_layer, pp, vp, layout):
    chunks = stage_chunks(n_layer, pp, vp, layout)
    assert sorted(i for stage in chunks for chunk in stage for i in chunk) == list(range(n_layer))
    for s, stage in enumerate(chunks):
        assert len(stage) == vp
        for c, layers in enumerate(stage):
            assert len(layers) > 0 and layers.start == megatron_offset(n_layer, pp, vp, s, c, layout)


def test_llama3_405b_stage_sizes():
    sizes = [sum(map(len, stage)) for stage in stage_chunks(126, 16, 4, Layout(embedding=True, loss=True))]
    assert sizes == [7] + [8] * 14 + [7]
    assert [sum(map(len, stage)) for stage in stage_chunks(126, 16, 1, Layout(first=7, last=7))] == sizes


@pytest.mark.parametrize("fields,n_layer,message", [
    (dict(pp=4, first_stage_layers=3, last_stage_layers=3), 13, "leave 7 of the model's 13 layers for 2 other "
                                                              "stage(s) of --pp 4; the stage counts must sum to 13"),
    (dict(pp=2, first_stage_layers=3, last_stage_layers=3), 8, "the stage counts must sum to 8"),
    (dict(pp=2, first_stage_layers=9), 8, "leave -1 of the model's 8 layers"),
    (dict(pp=3, first_stage_layers=4, last_stage_layers=4), 8, "leave no layer for the other 1 stage"),
    (dict(pp=4, first_stage_layers=3, last_stage_layers=3, virtual_stages=2, microbatches=4), 14,
     "--virtual_stages 2 must divide every stage's layers (first 3, others 4, last 3"),
    (dict(pp=2, account_for_embedding=True, virtual_stages=2, microbatches=2), 8,
     "8 layers with the embedding and loss counted (9) do not divide into --pp 2 x --virtual_stages 2"),
    (dict(pp=2, account_for_embedding=True, account_for_loss=True, virtual_stages=2, microbatches=2), 2,
     "chunk 0 of stage 0 would hold no Transformer layer"),
    (dict(pp=2, first_stage_layers=1, account_for_loss=True), 8, "use one (Megatron-Core refuses both too)"),
    (dict(pp=1, first_stage_layers=1), 8, "they need --pp > 1"),
    (dict(pp=2, last_stage_layers=0), 8, "--last_stage_layers must be at least 1, got 0"),
])
def test_bad_layouts_are_one_line(fields, n_layer, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        TrainPlan(seq=16, **fields).check(tiny_config("gpt2", n_layer=n_layer))
    assert "\n" not in str(e.value)


# --- symbolic traces ---------------------------------------------------------------------------------------

def traced_layers(graph) -> set[int]:
    return {int(d["module"].split(".")[1]) for _, d in graph.ops() if d["module"].startswith("layers.")}


def test_uneven_interleaved_trace_runs_each_stages_chunks_and_replicates():
    config = tiny_config("gpt2", n_layer=6, vocab_size=200)
    plan = TrainPlan(pp=2, virtual_stages=2, microbatches=4, seq=16, account_for_embedding=True,
                     account_for_loss=True)
    # 6 + 2 counted layers in 4 chunks of 2: the embedding's and the loss's chunks take one layer each
    assert [plan.stage(config, s).chunks for s in range(2)] == [(range(0, 1), range(3, 5)),
                                                                (range(1, 3), range(5, 6))]
    for s, layers in enumerate([{0, 3, 4}, {1, 2, 5}]):
        replicated, ran = trace_stage(config, plan, s), trace_stage(config, plan, s, replicate=False)
        assert traced_layers(ran) == layers
        assert dict(replicated.nodes(data=True)) == dict(ran.nodes(data=True))
        assert list(replicated.edges(data=True)) == list(ran.edges(data=True))
        sends = [d for _, d in ran.collectives() if d["collective"] == "send"]
        assert len(sends) == 2 * plan.microbatches * plan.virtual_stages - plan.microbatches


def test_uneven_middle_stage_derived_by_shifting_equals_tracing_it():
    config = tiny_config("gpt2", n_layer=12, vocab_size=200)
    plan = TrainPlan(pp=4, virtual_stages=2, microbatches=4, seq=16, first_stage_layers=2, last_stage_layers=2)
    assert traced_stage_for(config, plan) == [0, 1, 1, 3]  # the ends differ in layers: kinds of their own
    probe, blocks = probe_stage(config, plan, 1)
    derived = schedule_stage(shift_stage(probe, plan.mesh, 2, 2), blocks, plan)
    traced = trace_stage(config, plan, 2, replicate=False)
    assert traced_layers(traced) == {3, 4, 9, 10}
    assert dict(derived.nodes(data=True)) == dict(traced.nodes(data=True))
    assert list(derived.edges(data=True)) == list(traced.edges(data=True))


def test_uneven_interleaved_workload_validates(tmp_path):
    from syntorch.chakra.validator import check_traces
    from syntorch.workload import trace_workload, write_workload

    config = tiny_config("gpt2", n_layer=12, vocab_size=200)
    plan = TrainPlan(dp=2, tp=2, pp=4, virtual_stages=2, microbatches=4, seq=16, first_stage_layers=2,
                     last_stage_layers=2)
    summary = write_workload(trace_workload(config, plan, torch.float32), tmp_path, level="module", progress=False)
    assert [s["chunks"] for s in summary["stages"]] == [[[0, 0], [6, 6]], [[1, 2], [7, 8]], [[3, 4], [9, 10]],
                                                        [[5, 5], [11, 11]]]
    check_traces(tmp_path)


# --- real runs ---------------------------------------------------------------------------------------------

CONFIG = tiny_config("gpt2", n_layer=6, vocab_size=200)
REAL = {"interleaved_accounted": TrainPlan(pp=2, virtual_stages=2, microbatches=4, micro_batch_size=2, seq=16,
                                           lr=1e-2, account_for_embedding=True, account_for_loss=True),
        "first_last": TrainPlan(pp=2, microbatches=2, micro_batch_size=2, seq=16, lr=1e-2, first_stage_layers=2,
                                last_stage_layers=4)}


def batches(plan):
    return microbatches(CONFIG, plan)


def real_rank(out_dir: str) -> None:
    from syntorch.parallel import plans
    from syntorch.parallel.launch import init_distributed
    from syntorch.parallel.mesh import init_groups

    rank, _ = init_distributed("cpu")
    results = {}
    for name, plan in REAL.items():
        groups = init_groups(plan.mesh, CONFIG.tied_head)
        torch.manual_seed(0)
        run = plans.apply_plans(CONFIG, plan, groups, "cpu")
        loss = plans.train_step(run, batches(plan))
        results[name] = {"loss": None if loss is None else loss.item(),
                         "grads": {n: p.grad.tolist() for n, p in run.model.named_parameters()}}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)


def test_real_uneven_steps_equal_one_process(tmp_path):
    from syntorch.models import build_model
    from syntorch.parallel.launch import spawn

    spawn(real_rank, 2, (str(tmp_path),))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for (name, plan), stage0 in zip(REAL.items(), [{"0", "3", "4"}, {"0", "1"}]):
        ranks = [r[name] for r in results]
        torch.manual_seed(0)
        model = build_model(CONFIG, "cpu").train()
        x, y = (torch.cat(parts) for parts in zip(*batches(plan)))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), plan.clip_grad)  # the step clips by the global norm
        assert ranks[0]["loss"] is None and ranks[1]["loss"] == pytest.approx(loss.item(), abs=1e-5)
        assert {n.split(".")[1] for n in ranks[0]["grads"] if n.startswith("layers.")} == stage0
        grads = dict(model.named_parameters())
        for r in ranks:
            for key, grad in r["grads"].items():
                ref = grads["tok_emb.weight" if key == "lm_head.weight" else key].grad
                torch.testing.assert_close(torch.tensor(grad), ref, rtol=1e-4, atol=1e-5, msg=f"{name} {key}")


def test_memory_counts_each_uneven_chunks_layers_at_the_peak():
    from syntorch.parallel import memory

    config = tiny_config("gpt2", n_layer=6)
    plan = TrainPlan(pp=2, virtual_stages=2, microbatches=4, seq=16, account_for_embedding=True, account_for_loss=True)
    per_layer = memory.layer_activation_bytes(config, plan, 2)
    # stage 0 holds chunks of 1 and 2 layers. Its steps: F m0.0, m1.0, m0.1, m1.1 (warm-up: 1 + 1 + 2 + 2),
    # F m2.0 (7 layers alive), B m0.1 (5), F m3.0 (6), B m1.1 (4), F m2.1 (6), B m0.0 (5), F m3.1 (7), ...: 7 at
    # most, where 5 chunk-micro-batches of 1.5 layers on average would be 7.5
    assert memory.activation_bytes(config, plan, 2, plan.stage(config, 0)) == pytest.approx(7 * per_layer)

