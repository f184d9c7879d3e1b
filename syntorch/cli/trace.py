"""`syntorch trace`: a symbolic training step (or pipelined prefill) of a TP x CP x PP x DP plan at cluster scale,
written as one Chakra `.et` per rank, `comm_groups.json`, `tensor_trace_chakra.json` and `summary.json`."""


def add_parser(sub) -> None:
    from syntorch.cli.predict import add_attention, add_model
    from syntorch.options import named

    p = sub.add_parser("trace", help="symbolic training-step traces per rank (Chakra) for a TP x CP x PP x DP plan")
    m = p.add_argument_group("model")
    add_model(m)
    m.add_argument("--mode", default="train", choices=["train", "infer"],
                   help="train: forward, backward, optimizer; infer: the prefill forward, micro-batched through the stages")
    m.add_argument("--dtype", default="bf16", choices=["fp32", "fp16", "bf16", "fp8"],
                   help="fp8: Linear GEMMs in FP8 as Transformer Engine runs them, the rest in bf16 (needs an FP8 GPU)")
    par = p.add_argument_group("parallelism (ranks in Megatron's order tp-cp-pp-dp: TP innermost, parallel/mesh.py)")
    par.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (Megatron)")
    par.add_argument("--pp", type=int, default=1, help="pipeline stages (contiguous layers)")
    par.add_argument("--ep", type=int, default=1, help="expert parallel (MoE models): splits the experts over "
                     "groups of this many ranks, carved out of each stage's TP x CP x DP ranks after --etp "
                     "(Megatron-Core's layout)")
    par.add_argument("--etp", type=int, default=None, help="the experts' own tensor-parallel size (Megatron-Core's "
                     "--expert-tensor-parallel-size); divides --tp, default --tp; 1: each expert whole on a rank")
    par.add_argument("--moe_load", default="uniform", metavar="uniform|zipf:S|FILE.json",
                     help="routing load of symbolic MoE runs: uniform, a Zipf skew S, or a JSON file "
                          "{\"tokens_per_expert\": [[one number per expert], one row per MoE layer]}")
    par.add_argument("--cp", type=int, default=1, help="context parallel: each sequence split over cp ranks "
                     "(2 * cp load-balanced chunks, K/V all-gathered)")
    par.add_argument("--sp", action="store_true", help="sequence parallel (needs --tp > 1)")
    par.add_argument("--zero", type=int, default=0, help="0: DDP all-reduce; 1, 2: ZeRO stage 1 or 2; "
                     "3: fully sharded (FSDP)")
    par.add_argument("--fsdp", action="store_true", help="fully sharded data parallel: --zero 3")
    par.add_argument("--bucket_mb", type=float, default=25.0, help="gradient bucket size in MiB (DDP's default 25)")
    par.add_argument("--overlap_grad_reduce", type=_flag, default=True, metavar="true|false",
                     help="launch each DP gradient bucket as soon as backward fills it (default true, as NeMo's "
                          "recipes; Megatron-Core's default is false: all after backward)")
    par.add_argument("--clip_grad", type=float, default=1.0, at_least=0,
                     help="clip gradients by their global norm (Megatron's default 1.0; 0: no clipping)")
    par.add_argument("--overlap_param_gather", type=_flag, default=False, metavar="true|false",
                     help="ZeRO: all-gather updated parameters during the next forward instead of after the "
                          "optimizer step (default false, as Megatron-Core)")
    par.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"], help="pipeline schedule")
    par.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                     help="activation recomputation in backward: selective (the attention core) or full (each layer)")
    par.add_argument("--virtual_stages", type=int, default=1,
                     help="interleaved 1F1B: chunks of layers per stage (Megatron's virtual pipeline; 1: none)")
    par.add_argument("--first_stage_layers", type=int, default=None,
                     help="layers on the first pipeline stage, the others shared evenly by the middle stages "
                          "(Megatron-Core's --decoder-first-pipeline-num-layers)")
    par.add_argument("--last_stage_layers", type=int, default=None,
                     help="layers on the last pipeline stage (Megatron-Core's --decoder-last-pipeline-num-layers)")
    par.add_argument("--account_for_embedding", action="store_true",
                     help="count the embedding as a layer in the pipeline split: the first chunk takes one layer "
                          "fewer (Megatron-Core's --account-for-embedding-in-pipeline-split)")
    par.add_argument("--account_for_loss", action="store_true",
                     help="count the loss as a layer in the pipeline split: the last chunk takes one layer fewer "
                          "(Megatron-Core's --account-for-loss-in-pipeline-split)")
    par.add_argument("--reshard_after_forward", type=_flag, default=True, metavar="true|false",
                     help="FSDP: free gathered parameters after forward (default true, as FSDP2); false keeps them "
                          "whole until backward, which then gathers nothing (as Llama 3 runs it)")
    par.add_argument("--grad_reduce_dtype", default="model", choices=["model", "fp32"],
                     help="dtype of the DP gradient reduction (default model, as FSDP2; fp32 as Llama 3 and "
                          "Megatron-Core's bf16 default accumulate_allreduce_grads_in_fp32)")
    par.add_argument("--no_scatter_gather", "--no-scatter-gather-tensors-in-pipeline", dest="scatter_gather",
                     action="store_false", help="with --tp > 1 and --pp > 1, send the whole stream between stages "
                     "from every TP rank (default: Megatron's scatter/gather, 1/tp each and an all-gather over TP)")
    par.add_argument("--world_size", type=int, help="check that dp * pp * cp * tp equals it")
    b = p.add_argument_group("batch")
    b.add_argument("--microbatches", type=int, default=1, help="micro-batches per step (per DP replica)")
    b.add_argument("--micro_batch_size", type=int, default=1)
    b.add_argument("--global_batch", type=int, help="check that dp * microbatches * micro_batch_size equals it")
    b.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's context)")
    out = p.add_argument_group("outputs")
    out.add_argument("--hw_config", type=named, help="hardware preset (a100-80gb, h100-sxm, h200-sxm, cpu) or JSON file: durations")
    out.add_argument("--profile", default="eager",
                     help="software profile of the durations: eager (one kernel per aten op) or fused (Megatron's kernels)")
    add_attention(out)
    out.add_argument("--trace_level", default="module", choices=["op", "module"], help="one Chakra node per op or per module")
    out.add_argument("--predict_only", action="store_true",
                     help="predict the step (needs --hw_config) without writing Chakra files: summary.json, timeline.json")
    out.add_argument("--out", default="runs/trace", help="output folder")
    out.add_argument("--force", action="store_true", help="replace the outputs of an earlier syntorch run in --out")
    out.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _flag(value: str) -> bool:
    import argparse
    if value.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return value.lower() == "true"


def run(args) -> int:
    from syntorch.checkpoints import resolve_model_config
    from syntorch.config import from_args, torch_dtype
    from syntorch.hardware import load_hw_config
    from syntorch.outdir import check_output_dir
    from syntorch.parallel.fp8 import check_fp8
    from syntorch.parallel.moe_load import parse_load
    from syntorch.parallel.plans import TrainPlan
    from syntorch.cli.predict import print_prediction
    from syntorch.errors import UserError
    from syntorch.simulate.prediction import predict_training, write_prediction
    from syntorch.trace.cost import check_profile, check_profile_needs_hw
    from syntorch.workload import trace_workload, write_workload

    check_output_dir(args.out, args.force, "--out", new_files=["summary.json"])  # before the work, not after it
    check_profile_needs_hw(args.profile, args.hw_config, args.attention)
    if args.fsdp:
        if args.zero not in (0, 3):
            raise UserError(f"--fsdp is --zero 3; drop --zero {args.zero} or --fsdp")
        args.zero = 3
    config = resolve_model_config(args.model, args.model_config)
    plan = from_args(TrainPlan, args, seq=config.n_positions if args.seq is None else args.seq,
                     fp8=args.dtype == "fp8", moe_load=parse_load(args.moe_load, config))
    plan.check(config, args.world_size, args.global_batch)
    if args.predict_only and not args.hw_config:
        raise UserError("--predict_only predicts from a hardware model; give --hw_config")
    check_profile(args.profile)
    hw = load_hw_config(args.hw_config) if args.hw_config else None
    if plan.fp8:
        check_fp8(hw)
    workload = trace_workload(config, plan, torch_dtype(args.dtype), hw, schedule=not args.predict_only,
                              profile=args.profile, attention=args.attention)
    prediction = predict_training(workload.probes, workload.source, plan, hw, args.profile, args.attention,
                                  workload.kind_probes) \
        if hw else None
    if args.predict_only:
        record = {"model": config.name, "plan": vars(plan), "world_size": plan.mesh.world_size,
                  "hw_config": hw.name, "predicted": prediction.summary}
        write_prediction(args.out, record, prediction, "summary.json", args.force)
    else:
        print_summary(write_workload(workload, args.out, args.trace_level, args.force, not args.no_progress, prediction))
    if prediction:
        print_prediction(prediction.summary)
    return 0


def print_summary(summary: dict) -> None:
    from syntorch.console import console as make_console
    from rich.table import Table

    table = Table(title=f"{summary['model']}: {summary['world_size']} ranks, "
                        f"{summary['distinct_rank_traces']} distinct rank traces ({summary['traced_stages']} stages traced"
                        + (f" x {summary['kinds_per_stage']} rank kinds" if summary["kinds_per_stage"] > 1 else "") + ")")
    for column in ("stage", "layers", "ranks", "TFLOP", "compute GB", "comm GB", "chakra nodes", "compute ms", "comm ms",
                   "memory GB"):
        table.add_column(column, justify="right")
    for s in summary["stages"]:
        table.add_row(str(s["stage"]), ",".join(f"{a}-{b}" for a, b in s["chunks"]), str(len(s["ranks"])),
                      f"{sum(s['flops'].values()) / 1e12:.1f}", f"{s['compute_bytes'] / 1e9:.1f}",
                      f"{s['comm_bytes'] / 1e9:.2f}", str(s["chakra_nodes"]),
                      f"{s['compute_us'] / 1e3:.1f}", f"{s['comm_us'] / 1e3:.1f}",
                      f"{s['memory_bytes']['total'] / 1e9:.1f}")
    console = make_console()
    console.print(table)
    console.print(f"{summary['et_bytes'] / 1e6:.1f} MB of .et, {summary['comm_groups']} comm groups -> {summary['dir']} "
                  f"(check with: syntorch validate {summary['dir']})")
    console.print(memory_note(max(s["memory_bytes"]["total"] for s in summary["stages"])), highlight=False)
    if summary["kinds_per_stage"] > 1 and summary["all_to_all_as_p2p"]:
        console.print("--moe_load gives EP ranks all-to-alls of their own sizes: written as each pair's sends and "
                      "recvs, which ASTRA-sim runs", highlight=False)
    elif summary["kinds_per_stage"] > 1:
        console.print("--moe_load gives EP ranks all-to-alls of their own sizes: syntorch predict simulates them, "
                      "ASTRA-sim needs one size per group and hangs (syntorch validate names each)", highlight=False)


def memory_note(peak_bytes: float) -> str:
    """Without --hw_config nothing was checked: say which presets the busiest rank's estimate would fit."""
    from syntorch.hardware import PRESETS

    fits = [name for name, hw in PRESETS.items() if peak_bytes <= hw.memory_gb * 1e9]
    where = f"fits {', '.join(fits)}" if fits else "exceeds the memory of every preset"
    return f"estimated peak memory per rank {peak_bytes / 1e9:.1f} GB: {where} (--hw_config checks it before tracing)"
