"""A whole stage's probe derived from a probe of four layers per run (trace/expanded_probe.py) against
probing every layer (training.probe_stage): the same graph node for node and edge for edge, the same step
blocks; and the Chakra files written from it against those written from probing every layer, byte for byte."""
import filecmp
import json

import pytest
import torch

from conftest import tiny_config
from syntorch.hardware import load_hw_config
from syntorch.parallel.plans import TrainPlan
from syntorch.trace.expanded_probe import expanded_probe
from syntorch.trace.training import PROBE_MICROBATCHES, probe_stage
from syntorch.simulate.chakra_files import RANK_KINDS as RANKS
from syntorch.workload import trace_workload, write_workload

GPT = tiny_config("gpt2", n_layer=16, d_model=128, n_head=4, d_head=32, d_ff=512, vocab_size=128)
GPT32 = tiny_config("gpt2", n_layer=32, d_model=64, n_head=4, d_head=16, d_ff=256, vocab_size=128)  # 8-layer chunks
LLAMA = tiny_config("llama-3-8b", n_layer=16, d_model=128, n_head=4, n_kv_head=2, d_head=32, d_ff=256, vocab_size=128)
MOE = tiny_config("deepseek-v3", n_layer=16, n_head=4, d_head=24, rotary_dim=8, v_head_dim=12, kv_lora_rank=16,
                  q_lora_rank=24, n_experts=8, d_ff_expert=32, d_ff=64, moe_top_k=3, first_k_dense=3,
                  moe_n_group=4, moe_topk_group=2, rope_original_positions=16)

DERIVED = {  # (config, plan, stages derived)
    "tp": (GPT, TrainPlan(tp=2, microbatches=4, seq=32), [0]),
    "zero1_sp": (GPT, TrainPlan(dp=2, tp=2, sp=True, zero=1, microbatches=4, seq=32), [0]),
    "one_microbatch": (GPT, TrainPlan(dp=2, tp=2, sp=True, zero=1, microbatches=1, seq=32), [0]),
    "ddp_overlap": (GPT, TrainPlan(dp=2, microbatches=3, seq=32, bucket_mb=0.1), [0]),
    "ddp_no_overlap": (GPT, TrainPlan(dp=2, microbatches=3, seq=32, bucket_mb=0.1, overlap_grad_reduce=False), [0]),
    "ddp_tp_pp_recompute": (GPT, TrainPlan(dp=2, tp=2, pp=2, microbatches=3, seq=32, bucket_mb=0.01,
                                           recompute="full"), [0, 1]),
    "pp_recompute": (LLAMA, TrainPlan(tp=2, pp=2, microbatches=4, seq=32, recompute="full"), [0, 1]),
    "zero2_pp": (LLAMA, TrainPlan(dp=2, pp=2, zero=2, microbatches=4, seq=32, bucket_mb=0.1), [0, 1]),
    "zero1_sp_interleaved": (GPT32, TrainPlan(dp=2, tp=2, pp=2, virtual_stages=2, sp=True, zero=1, microbatches=4,
                                              seq=32, bucket_mb=0.01), [0]),
    "moe_dense_first": (MOE, TrainPlan(pp=2, microbatches=4, seq=32), [0, 1]),
}
WHOLE = {  # probed whole: FSDP, CP
    "fsdp": (GPT, TrainPlan(dp=2, pp=2, zero=3, microbatches=4, seq=32)),
    "cp": (LLAMA, TrainPlan(dp=2, cp=2, microbatches=2, seq=32)),
}


@pytest.mark.parametrize("name", DERIVED)
def test_a_derived_probe_is_the_probe_of_every_layer(name):
    config, plan, stages = DERIVED[name]
    for stage in stages:
        graph, blocks = expanded_probe(config, plan, stage, torch.float32, PROBE_MICROBATCHES)
        whole, whole_blocks = probe_stage(config, plan, stage, torch.float32, microbatches=PROBE_MICROBATCHES)
        assert blocks == whole_blocks
        assert dict(graph.nodes(data=True)) == dict(whole.nodes(data=True))
        assert list(graph.edges(data=True)) == list(whole.edges(data=True))
        assert graph.graph == whole.graph


@pytest.mark.parametrize("name", WHOLE)
def test_stages_a_probe_of_fewer_layers_cannot_stand_for_are_probed_whole(name):
    config, plan = WHOLE[name]
    assert expanded_probe(config, plan, 0, torch.float32, PROBE_MICROBATCHES) is None


@pytest.mark.parametrize("name", ["zero1_sp", "pp_recompute"])
def test_files_written_from_a_derived_probe_are_those_of_probing_every_layer(name, tmp_path):
    config, plan, _ = DERIVED[name]
    hw = load_hw_config("h100-sxm")
    for layer_probes in (True, False):
        workload = trace_workload(config, plan, torch.float32, hw, layer_probes=layer_probes)
        write_workload(workload, tmp_path / str(layer_probes), progress=False)
    files = sorted(p.name for p in (tmp_path / "True").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "False").iterdir())
    _, differ, errors = filecmp.cmpfiles(tmp_path / "True", tmp_path / "False", files, shallow=False)
    assert differ == [RANKS] and not errors  # its files' fingerprints hold modification times: without them
    assert _sizes(tmp_path / "True" / RANKS) == _sizes(tmp_path / "False" / RANKS)


def _sizes(path) -> dict:
    ranks = json.loads(path.read_text())
    return {**ranks, "files": [size for size, _ in ranks["files"]]}
