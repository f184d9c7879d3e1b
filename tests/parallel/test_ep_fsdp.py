"""Expert parallelism composed with context parallelism, FSDP and its own TP size (--etp): real steps on gloo
equal one process (loss and every gradient, or every FSDP shard's gradient), and the symbolic traces of
those layouts validate."""
import json

import pytest
import torch
from conftest import tiny_config
from plan_steps import global_batch, reference_step

from syntorch.chakra.validator import check_traces
from syntorch.cli import main
from syntorch.config import save_model_config
from syntorch.errors import UserError
from syntorch.parallel.plans import TrainPlan

MOE = tiny_config("gpt2", n_layer=2, vocab_size=200, n_experts=4, moe_top_k=2)
# SwiGLU experts without biases and a shared expert (DeepSeekMoE's), which --etp between 1 and --tp needs
GATED = tiny_config("llama-2-7b", n_kv_head=4, vocab_size=200, n_experts=4, moe_top_k=2, n_shared_experts=1,
                    d_ff_expert=64)
# DeepSeek-V3's MLA (a TP region of its own) with its dense first layer and grouped routing
MLA = tiny_config("deepseek-v3", n_layer=3, n_head=4, d_head=24, rotary_dim=8, v_head_dim=12, kv_lora_rank=16,
                  q_lora_rank=24, n_experts=8, d_ff_expert=32, d_ff=64, moe_top_k=3, first_k_dense=1,
                  rope_original_positions=16, moe_n_group=4, moe_topk_group=2, vocab_size=200)
BASE = dict(microbatches=2, micro_batch_size=2, seq=8, lr=1e-2)
PLANS = {
    "ep_cp": TrainPlan(cp=2, ep=2, **BASE),  # the EP group is the CP pair
    "ep_cp_fsdp": TrainPlan(dp=2, cp=2, ep=2, zero=3, **BASE),  # experts sharded over the DP pair (expert-DP)
    "etp1": TrainPlan(tp=2, etp=1, ep=2, **BASE),  # whole experts; the EP group is the TP pair, tokens halved
    "ep_tp": TrainPlan(tp=2, dp=2, ep=2, **BASE),  # experts TP-sharded (etp = tp), EP over the DP pair
    "ep_tp_fsdp": TrainPlan(tp=2, dp=4, ep=2, zero=3, **BASE),  # and FSDP: experts over expert-DP (2 ranks)
    "etp2_of_tp4": TrainPlan(tp=4, etp=2, ep=2, **BASE),  # experts halved over 2 ranks; EP: the 2 TP halves
    # sequence parallel: the MoE layer gathers the sequence and reduce-scatters its output (Megatron-Core
    # requires SP with TP and EP); TP2 SP without EP: tests/parallel/test_qwen3_gpt_oss_parallel.py
    "ep_tp_sp": TrainPlan(tp=2, dp=2, ep=2, sp=True, **BASE),
    "etp2_of_tp4_sp": TrainPlan(tp=4, etp=2, ep=2, sp=True, **BASE),  # each TP half routes its slice
    "mla_ep_tp_sp": TrainPlan(tp=2, dp=2, ep=2, sp=True, **BASE),
}
CONFIGS = {"etp2_of_tp4": GATED, "etp2_of_tp4_sp": GATED, "mla_ep_tp_sp": MLA}


def global_name(model, name: str) -> str:
    """A parameter's name in the whole model: an expert's local index on its EP rank -> its global index."""
    head, _, tail = name.partition(".experts.")
    if not tail or not hasattr(model.get_submodule(head), "first_expert"):  # not an expert, or no EP
        return name
    local, _, rest = tail.partition(".")
    return f"{head}.experts.{model.get_submodule(head).first_expert + int(local)}.{rest}"


def rank_steps(out_dir: str, names: list[str]) -> None:
    """Each plan's step in turn, on one launch of ranks for all plans of a world size (starting 4 ranks costs
    more than a step): each builds its own groups and model from seed 0, as on ranks of its own."""
    for name in names:
        rank_step(f"{out_dir}/{name}", name)


def rank_step(out_dir: str, name: str) -> None:
    from syntorch.parallel import distributed as comm, plans
    from syntorch.parallel.launch import init_distributed
    from syntorch.parallel.mesh import init_groups

    rank, _ = init_distributed("cpu")
    plan, config = PLANS[name], CONFIGS.get(name, MOE)
    torch.manual_seed(0)
    run = plans.apply_plans(config, plan, init_groups(plan.mesh, config.tied_head), "cpu")
    x, y = global_batch(config, plan)
    rows, b = plan.microbatches * plan.micro_batch_size, plan.micro_batch_size
    d = plan.mesh.coordinate(rank).dp
    loss = plans.train_step(run, [(x[i:i + b], y[i:i + b]) for i in range(d * rows, (d + 1) * rows, b)])
    styles = run.tp_plan.styles if run.tp_plan else {}
    # id -> (name in the whole model, TP style of its module)
    names = {id(p): (global_name(run.model, n), styles.get(n.rpartition(".")[0]))
             for n, p in run.model.named_parameters()}
    out = {"loss": loss.item(), "tp_rank": run.groups.tp_rank,
           "grads": {names[id(p)][0]: (names[id(p)][1], p.grad.tolist())
                     for p in run.model.parameters() if p.grad is not None},
           "shards": [{"names": [names[id(p)] for p in u.params], "grad": u.shard.grad.tolist(),
                       "index": comm.rank_in(u.group) if u.size > 1 else 0, "size": u.size}
                      for u in getattr(run.grad_sync, "units", [])]}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(out, f)


def expected(ref: torch.Tensor, name: str, style: str | None, plan: TrainPlan, tp_rank: int, config) -> torch.Tensor:
    """The reference gradient as this rank holds it: its TP shard (tensor.py's `style`), its ETP shard for
    an expert when --etp is not --tp (expert.py), or whole."""
    from syntorch.parallel.tensor import padded_vocab, take_shard

    param = name.rpartition(".")[2]
    if ".experts." in name and plan.etp not in (1, plan.tp):
        style = "rowwise" if ".fc2." in name else "colwise_gated"
        return take_shard(style, param, ref, tp_rank % plan.etp, plan.etp, 0, 0)
    if plan.tp == 1 or style is None:
        return ref
    return take_shard(style, param, ref, tp_rank, plan.tp, padded_vocab(config.vocab_size, plan.tp), config.d_head,
                      config.kv_heads)


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    """name -> the folder of its ranks' steps; the plans of a world size run on one launch, the first time a
    test asks for one of them."""
    from syntorch.parallel.launch import spawn

    folders = {}

    def folder(name):
        if name not in folders:
            world = PLANS[name].mesh.world_size
            names = [n for n in PLANS if PLANS[n].mesh.world_size == world]
            root = tmp_path_factory.mktemp(f"world{world}")
            for n in names:
                (root / n).mkdir()
            spawn(rank_steps, world, (str(root), names))
            folders.update({n: root / n for n in names})
        return folders[name]
    return folder


@pytest.mark.parametrize("name", PLANS)
def test_real_step_equals_one_process(stepped, name):
    plan, config = PLANS[name], CONFIGS.get(name, MOE)
    folder = stepped(name)
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(plan.mesh.world_size)]
    ref_loss, ref_grads, _ = reference_step(config, plan)
    assert sum(r["loss"] for r in ranks) / len(ranks) == pytest.approx(ref_loss, abs=1e-5)
    seen = set()
    for r in ranks:
        for n, (style, g) in r["grads"].items():
            want = expected(ref_grads[n], n, style, plan, r["tp_rank"], config)
            torch.testing.assert_close(torch.tensor(g), want, atol=1e-5, rtol=1e-4, msg=n)
            seen.add(n)
        for unit in r["shards"]:  # fsdp.py's layout: the unit's gradients flattened, padded, this rank's part
            flat = torch.cat([expected(ref_grads[n], n, style, plan, r["tp_rank"], config).flatten()
                              for n, style in unit["names"]])
            flat = torch.cat([flat, flat.new_zeros(-flat.numel() % unit["size"])])
            torch.testing.assert_close(torch.tensor(unit["grad"]), flat.chunk(unit["size"])[unit["index"]],
                                       atol=1e-5, rtol=1e-4, msg=str(unit["names"][:2]))
            seen.update(n for n, _ in unit["names"])
    assert seen == set(ref_grads)  # every expert lives somewhere


def test_traces_of_ep_with_fsdp_cp_and_etp_validate_and_predict(tmp_path):
    config = tmp_path / "moe.json"
    save_model_config(MOE, config)
    out = tmp_path / "run"
    assert main(["trace", "--model_config", str(config), "--seq", "16", "--microbatches", "2", "--out", str(out),
                 "--no_progress", "--dp", "2", "--cp", "2", "--tp", "2", "--etp", "1", "--ep", "4", "--pp", "2",
                 "--zero", "3", "--hw_config", "h100-sxm"]) == 0
    assert check_traces(out)[0] == []
    groups = {tuple(g) for g in json.loads((out / "comm_groups.json").read_text()).values()}
    # stage 0's ranks 0-3 and 8-11 (dp 1): EP groups of tp/etp x cp = 4, expert-DP along dp
    assert (0, 1, 2, 3) in groups and (0, 8) in groups
    predicted = json.loads((out / "summary.json").read_text())["predicted"]
    assert predicted["step_s"] > 0 and predicted["ranks"] == 16


@pytest.mark.parametrize("bad, words", [(dict(tp=4, etp=3, ep=2, dp=2), "--etp 3 must divide --tp 4"),
                                        (dict(tp=2, etp=1, dp=2), "needs --ep > 1"),
                                        (dict(tp=2, cp=3, etp=1, ep=4, dp=2, seq=12), "must divide one another")])
def test_bad_expert_layouts(bad, words):
    with pytest.raises(UserError, match=words):
        TrainPlan(**{"seq": 16, **bad}).check(tiny_config("llama-2-7b", n_kv_head=4, n_experts=8, moe_top_k=2))


def test_fsdp_experts_on_one_replica_hold_them_whole():
    """EP over all of DP (expert-DP of one rank): each layer's experts are a unit of their own that moves
    nothing; the dense units still all-gather and reduce-scatter over DP."""
    from syntorch.models import build_model
    from syntorch.trace.training import trace_stage

    plan = TrainPlan(dp=2, ep=2, zero=3, seq=16)
    assert plan.expert_dp == 1
    graph = trace_stage(MOE, plan, 0)
    sharded = [d for _, d in graph.collectives() if d["collective"] in ("all_gather", "reduce_scatter")]
    assert sharded and all(d["group"] == [0, 1] for d in sharded)
    dense = sum(p.numel() for n, p in build_model(MOE, "meta").named_parameters() if ".experts." not in n)
    scattered = sum(d["bytes"] for d in sharded if d["collective"] == "reduce_scatter")
    assert dense * 4 <= scattered < (dense + 2 * 3) * 4  # the dense units only (each padded to even)


def test_an_etp_that_does_not_divide_is_one_line(tmp_path, capsys):
    config = tmp_path / "moe.json"
    save_model_config(MOE, config)
    assert main(["trace", "--model_config", str(config), "--tp", "4", "--etp", "3", "--dp", "2", "--ep", "2",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--etp 3 must divide --tp 4" in err[0]
