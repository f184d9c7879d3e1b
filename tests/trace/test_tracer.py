import networkx as nx
import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from conftest import tiny_config
from syntorch.generate import Sampling, generate
from syntorch.models import build_model
from syntorch.trace import Tracer, trace_generation

B, T = 2, 8


def run_model(model, device="cpu", backward=False):
    x = torch.randint(0, 128, (B, T), device=device)
    logits = model(x)
    if backward:
        logits.sum().backward()


def trace(base, device="cpu", backward=False):
    model = build_model(tiny_config(base), device=device).train()
    with Tracer(model) as tracer:
        run_model(model, device, backward)
    return tracer.graph, model


def _cpu_flash_fwd(query, key, value, *args, **kwargs):
    return sdpa_flop_count(query, key, value)


def _cpu_flash_bwd(grad_out, query, key, value, *args, **kwargs):
    return sdpa_backward_flop_count(grad_out, query, key, value)


def dense_total(graph) -> int:
    """The trace's FLOPs with attention over every score, as flop_counter counts it (`flops` keeps the causal part)."""
    return sum(d.get("dense_flops", d["flops"]) for _, d in graph.ops())


def flop_counter_total(base, backward):
    """FlopCounterMode on an untraced run; CPU's flash-attention kernel is given flop_counter's own sdpa
    formulas (it has none registered for the _for_cpu variants)."""
    aten = torch.ops.aten
    mapping = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_fwd,
               aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_bwd}
    model = build_model(tiny_config(base)).train()
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        run_model(model, backward=backward)
    return counter.get_total_flops()


@pytest.mark.parametrize("base", ["gpt2", "gptj-6b"])
@pytest.mark.parametrize("backward", [False, True])
def test_total_flops_equal_flop_counter_mode(base, backward):
    graph, _ = trace(base, backward=backward)
    assert dense_total(graph) == flop_counter_total(base, backward) > graph.total_flops()


@pytest.mark.parametrize("base", ["gpt2", "gptj-6b"])
def test_linear_flops_per_module_forward_and_backward(base):
    graph, model = trace(base, backward=True)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, linear in linears.items():
        forward = 2 * linear.in_features * linear.out_features * B * T
        for phase, expected in (("forward", forward), ("backward", 2 * forward)):
            got = sum(d["flops"] for _, d in graph.ops() if d["module"] == name and d["phase"] == phase)
            assert got == expected, (name, phase)


def test_backward_ops_carry_their_module():
    # GPT-J feeds attn.qkv and mlp.fc1 from the same LayerNorm: ModuleTracker merges them in backward
    graph, _ = trace("gptj-6b", backward=True)
    backward = [d for _, d in graph.ops() if d["phase"] == "backward"]
    mms = [d for d in backward if d["name"] == "aten.mm"]
    assert {d["module"] for d in mms} == {f"layers.{i}.{m}" for i in range(2) for m in
                                          ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")} | {"lm_head"}
    assert all(d["module"] for d in backward if d["flops"])
    layer_norms = [d["module"] for d in backward if d["name"] == "aten.native_layer_norm_backward"]
    assert layer_norms == ["ln_f", "layers.1.ln1", "layers.0.ln1"]


@pytest.mark.parametrize("backward", [False, True])
def test_attention_is_one_op_and_structure_does_not_depend_on_device(backward):
    sequences = {}
    for device in ("cpu", "meta"):
        graph, _ = trace("gpt2", device, backward)
        sequences[device] = [(d["name"], d["module"], d["phase"], d["flops"]) for _, d in graph.ops()]
        attention = [d for _, d in graph.ops() if d["name"].startswith("aten.scaled_dot_product_attention")]
        assert len(attention) == 2 * (1 + backward)
        assert not any(d["name"] in ("aten.bmm", "aten.softmax", "aten._softmax") for _, d in graph.ops())
    assert sequences["cpu"] == sequences["meta"]


def test_tensor_nodes_views_and_params():
    graph, model = trace("gpt2")
    qkv_weight = [d for _, d in graph.tensors() if d["name"] == "layers.0.attn.qkv.weight"]
    assert len(qkv_weight) == 1 and qkv_weight[0]["is_param"] and qkv_weight[0]["shape"] == [192, 64]
    assert qkv_weight[0]["bytes"] == 192 * 64 * 4
    views = [d for _, d in graph.ops() if d["is_view"]]
    assert views and all(d["bytes_read"] == d["bytes_written"] == 0 for d in views)
    mm = next(d for _, d in graph.ops() if d["module"] == "layers.0.attn.qkv" and d["flops"])
    assert mm["bytes_read"] == 4 * (192 + B * T * 64 + 192 * 64) and mm["bytes_written"] == 4 * B * T * 192
    for op, d in graph.ops():  # argument positions on every edge, in order
        assert [graph.edges[t, op]["arg"] for t in graph.predecessors(op)] == sorted(
            graph.edges[t, op]["arg"] for t in graph.predecessors(op))


def test_generation_flops_equal_flop_counter_mode():
    from syntorch.generate import generate
    model = build_model(tiny_config("gptj-6b"))
    prompt = torch.randint(0, 128, (2, 5))
    graph, result = trace_generation(model, prompt, 3, Sampling(temperature=0))
    aten = torch.ops.aten
    with FlopCounterMode(display=False, custom_mapping={
            aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_fwd}) as counter:
        untraced = generate(model, prompt, 3, Sampling(temperature=0))
    assert untraced.tokens == result.tokens
    assert dense_total(graph) == counter.get_total_flops() > graph.total_flops()
    # under inference_mode aten.linear arrives whole; it is recorded as the t + addmm it decomposes into
    for phase, tokens in (("prefill", 2 * 5), ("decode[0]", 2), ("decode[1]", 2)):
        fc1 = sum(d["flops"] for _, d in graph.ops() if d["module"] == "layers.1.mlp.fc1" and d["phase"] == phase)
        assert fc1 == 2 * 64 * 256 * tokens


def test_generation_phases_and_kv_cache_data_flow():
    model = build_model(tiny_config("gpt2"))
    graph, result = trace_generation(model, torch.randint(0, 128, (1, 5)), 3, Sampling(temperature=0))
    assert nx.is_directed_acyclic_graph(graph)
    assert {d["phase"] for _, d in graph.ops()} == {"prefill", "decode[0]", "decode[1]"}
    cache = [(n, d) for n, d in graph.tensors() if d["name"] == "layers.1.attn.kv_cache.k"]
    assert [d["version"] for _, d in cache] == list(range(len(cache))) and len(cache) >= 4
    # decode[1]'s attention reads keys written by prefill's and decode[0]'s cache updates
    attention = [n for n, d in graph.ops() if d["phase"] == "decode[1]" and d["module"] == "layers.1.attn"
                 and d["name"] == "aten.scaled_dot_product_attention"]
    writers = {graph.nodes[a]["phase"] for a in nx.ancestors(graph, attention[0])
               if graph.nodes[a]["name"] == "aten.copy_" and graph.nodes[a]["module"] == "layers.1.attn"}
    assert writers == {"prefill", "decode[0]", "decode[1]"}


@pytest.mark.parametrize("sampling", [Sampling(temperature=0), Sampling(temperature=0.8, top_k=5, seed=1)])
def test_each_step_reads_the_token_the_step_before_chose(sampling):
    """The chosen token is traced and fed to the next step inside it, on cpu and on meta alike."""
    ops = {}
    for device in ("cpu", "meta"):
        model = build_model(tiny_config("gpt2"), device=device)
        graph, _ = trace_generation(model, torch.zeros(1, 4, dtype=torch.long, device=device), 3, sampling)
        choices = {d["phase"]: n for n, d in graph.ops() if d["name"] in ("aten.argmax", "aten.multinomial")}
        assert list(choices) == ["prefill", "decode[0]", "decode[1]"]
        for before, after in (("prefill", "decode[0]"), ("decode[0]", "decode[1]")):
            lookup = next(n for n, d in graph.ops() if d["phase"] == after and d["module"] == "tok_emb")
            assert nx.has_path(graph, choices[before], lookup)
        ops[device] = [(d["name"], d["module"], d["phase"]) for _, d in graph.ops()]
    assert ops["cpu"] == ops["meta"]


def test_beam_steps_read_the_beams_chosen_before_and_reorder_the_cache_inside():
    n_layer = 2
    model = build_model(tiny_config("gpt2", n_layer=n_layer))
    graph, result = trace_generation(model, torch.randint(0, 50, (1, 4)), 3, beam_width=2)
    assert len(result.new_tokens[0]) == 3
    phases = ["prefill", "decode[0]", "decode[1]"]
    choices = {}  # each step's first pick: the candidate tokens and beams
    for n, d in graph.ops():
        if d["name"] == "aten.topk":
            choices.setdefault(d["phase"], n)
    for before, after in zip(phases, phases[1:]):
        lookup = next(n for n, d in graph.ops() if d["phase"] == after and d["module"] == "tok_emb")
        assert nx.has_path(graph, choices[before], lookup)
        reorders = [n for n, d in graph.ops() if d["phase"] == after and d["name"] == "aten.index_select"]
        assert len(reorders) == 2 * n_layer  # keys and values of every layer follow their beams


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=4)
    yield dist.new_group([1, 2])
    dist.destroy_process_group()


@pytest.mark.parametrize("device", ["cpu", "meta"])  # (on meta the collectives are not called: meta_result)
def test_collectives_on_the_fake_backend(fake_world, device):
    x, pair = torch.ones(4, 8, device=device), fake_world
    with Tracer(rank=2, world_size=4) as tracer:
        dist.all_reduce(x, group=pair, op=dist.ReduceOp.MAX)
        dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.empty(8, 8, device=device), x, group=pair)
        dist.reduce_scatter_tensor(torch.empty(2, 8, device=device), x, group=pair, op=dist.ReduceOp.AVG)
        dist.broadcast(x, src=1, group=pair)
        dist.send(x, dst=1, group=pair, tag=7)
        dist.recv(x, src=1, group=pair, tag=7)
        y = x * 2
    got = [(d["collective"], d["group"], d["reduce_op"], d["bytes"], d["src"], d["dst"], d["tag"], d["order"])
           for _, d in tracer.graph.collectives()]
    assert got == [("all_reduce", [1, 2], "max", 128, None, None, 0, 0),
                   ("all_reduce", [0, 1, 2, 3], "sum", 128, None, None, 0, 0),
                   ("all_gather", [1, 2], None, 256, None, None, 0, 1),
                   ("reduce_scatter", [1, 2], "avg", 128, None, None, 0, 2),
                   ("broadcast", [1, 2], None, 128, 1, None, 0, 3),
                   ("send", [1, 2], None, 128, 2, 1, 7, 4),
                   ("recv", [1, 2], None, 128, 1, 2, 7, 5)]
    # the multiply reads the tensor recv wrote: collectives sit in the data flow
    mul = next(n for n, d in tracer.graph.ops() if d["name"] == "aten.mul")
    recv = next(n for n, d in tracer.graph.collectives() if d["collective"] == "recv")
    assert tracer.graph.op_deps()[mul] == [recv]
    assert nx.is_directed_acyclic_graph(tracer.graph)


@pytest.mark.parametrize("beam_width", [1, 2])
@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("base", ["gpt2", "gptj-6b"])
def test_replicated_layers_equal_a_full_trace(base, device, beam_width):
    """On meta only the first layer runs; on cpu every layer runs and only the first is recorded."""
    torch.manual_seed(0)
    model = build_model(tiny_config(base, n_layer=3), device=device)
    prompt = torch.randint(0, 50, (2, 5), device=device)
    greedy = dict(sampling=Sampling(temperature=0), beam_width=beam_width)
    full, full_run = trace_generation(model, prompt, 3, replicate=False, **greedy)
    replicated, replicated_run = trace_generation(model, prompt, 3, replicate=True, **greedy)
    if device == "cpu":  # the values went through every layer
        assert replicated_run.tokens == full_run.tokens == generate(model, prompt, 3, **greedy).tokens
    assert len(replicated) == len(full) > 0
    assert dict(replicated.nodes(data=True)) == dict(full.nodes(data=True))
    assert sorted(replicated.edges(data="arg")) == sorted(full.edges(data="arg"))
    assert replicated.graph == full.graph


def test_measured_durations_on_cpu():
    model = build_model(tiny_config("gpt2", d_model=256, d_head=64, d_ff=1024))
    with Tracer(model, time_ops=True) as tracer:
        run_model(model)
    ops = [d for _, d in tracer.graph.ops()]
    assert all(d["duration_us"] > 0 for d in ops)
    mm = sum(d["duration_us"] for d in ops if d["name"] == "aten.addmm")
    views = sum(d["duration_us"] for d in ops if d["is_view"])
    n_views = sum(1 for d in ops if d["is_view"])
    n_mm = sum(1 for d in ops if d["name"] == "aten.addmm")
    assert mm / n_mm > views / n_views  # a matmul takes longer than a view
    with Tracer(model) as untimed:
        run_model(model)
    assert not any("duration_us" in d for _, d in untimed.graph.ops())


def test_a_finished_tracer_is_freed_without_the_cyclic_collector():
    """Its modes point back at it and its tensor table holds 10^5 entries a training probe: left in a cycle they
    wait for the cyclic collector, whose passes then cost a probe ~15% (bench/probe_speed.py)."""
    import gc
    import weakref
    model = build_model(tiny_config("gpt2"), device="meta")
    enabled = gc.isenabled()
    gc.disable()
    try:
        with Tracer(model) as tracer, torch.no_grad():
            run_model(model, "meta")
        graph, freed = tracer.graph, weakref.ref(tracer)
        del tracer
        assert freed() is None and len(graph) > 0
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_storage_key_is_the_storage_objects_identity(device):
    """_storage_key reads torch's storage id without making a storage object: the same key as the storage's own
    (_cdata), shared by views, changed by a `.data` swap (FSDP's), and distinct for distinct storages."""
    from syntorch.trace.tracer import _storage_key
    a, b = torch.zeros(4, 6, device=device), torch.zeros(4, 6, device=device)
    views = [a, a.view(-1), a[1:], a.t(), a.unsqueeze(0)]
    assert {_storage_key(t) for t in views} == {a.untyped_storage()._cdata}
    assert _storage_key(b) == b.untyped_storage()._cdata != _storage_key(a)
    a.data = torch.zeros(24, device=device)
    assert _storage_key(a) == a.untyped_storage()._cdata != views[1].untyped_storage()._cdata


@pytest.mark.parametrize("plan", [
    dict(tp=2, pp=2, sp=True, microbatches=4, seq=32, recompute="full"),  # a forward recomputed in backward
    dict(dp=2, tp=2, zero=1, sp=True, microbatches=4, seq=32, bucket_mb=0.01, overlap_param_gather=True),  # buckets
    dict(dp=2, pp=2, zero=3, microbatches=3, seq=32)])  # FSDP: gathers in backward, reshards in the optimizer
def test_quiet_phases_trace_what_the_function_mode_would(monkeypatch, plan):
    """Backward and the optimizer run without the tracer's function mode (QUIET_PHASES): the same probe graphs,
    node for node and edge for edge, as with it."""
    import syntorch.trace.tracer as tracer_module
    from syntorch.parallel.plans import TrainPlan
    from syntorch.trace.training import probe_stage
    config, plan = tiny_config("llama-3-8b", n_layer=4, n_kv_head=2), TrainPlan(**plan)

    def probes():
        graphs = [probe_stage(config, plan, stage)[0] for stage in range(plan.pp)]
        return [(list(g.nodes(data=True)), list(g.edges(data=True))) for g in graphs]

    quiet = probes()
    monkeypatch.setattr(tracer_module, "QUIET_PHASES", ())
    assert quiet == probes()


def test_collectives_on_meta_trace_what_calling_them_would(monkeypatch):
    """A c10d op on meta is recorded with the result its meta kernel would return, without calling it
    (collectives.meta_result): the same probe graphs, node for node and edge for edge, as calling every one
    (tensor and sequence parallel, the distributed optimizer's buckets, pipeline sends and recvs)."""
    import syntorch.trace.collectives as collectives
    import syntorch.trace.tracer as tracer_module
    from syntorch.parallel.plans import TrainPlan
    from syntorch.trace.training import probe_stage
    config = tiny_config("gpt2")
    plan = TrainPlan(dp=2, tp=2, pp=2, sp=True, zero=1, microbatches=4, seq=32, bucket_mb=0.01)
    made = []

    def meta_result(func, args):
        out = collectives.meta_result(func, args)
        made.append(out is not None)
        return out

    def probes():
        graphs = [probe_stage(config, plan, stage)[0] for stage in range(plan.pp)]
        return [(list(g.nodes(data=True)), list(g.edges(data=True))) for g in graphs]

    monkeypatch.setattr(tracer_module, "meta_result", meta_result)
    made_graphs = probes()
    assert made and all(made)  # every collective of the probes was made, none called
    monkeypatch.setattr(collectives, "META_KERNELS", {})
    assert made_graphs == probes()
