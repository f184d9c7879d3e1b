"""`syntorch plan`: search the parallel layouts of a model on a cluster, ranked by predicted step time and
memory per rank; writes plans.csv, plans.json, plans.png (and, with --emit K, the top K layouts' traces)."""
import argparse

OUTPUTS = ["plans.csv", "plans.json", "plans.png"]


def add_parser(sub) -> None:
    from syntorch.cli.predict import add_attention, add_model
    from syntorch.options import named

    p = sub.add_parser("plan", help="search parallel layouts (TP, PP, DP, CP, EP, ZeRO, SP, recompute, micro-batches) "
                                    "ranked by predicted step time and memory per rank")
    m = p.add_argument_group("model and cluster")
    add_model(m)
    m.add_argument("--gpus", type=int, required=True, at_least=1, help="GPUs in the cluster")
    m.add_argument("--hw_config", type=named, help="hardware preset (a100-80gb, h100-sxm, h200-sxm) or JSON file "
                   "(every field, or \"base\": a preset and the fields that differ)")
    m.add_argument("--compare_hw", type=names, help="comma-separated presets or files: the best layouts of each, "
                   "side by side (instead of --hw_config)")
    m.add_argument("--gpus_per_node", type=int, at_least=1, help="GPUs per node (default: the hardware config's)")
    w = p.add_argument_group("work per step")
    batch = w.add_mutually_exclusive_group(required=True)
    batch.add_argument("--global_batch", type=int, at_least=1, help="sequences per step (Megatron's --global-batch-size)")
    batch.add_argument("--tokens_per_step", type=int, at_least=1, help="tokens per step: --global_batch x --seq")
    w.add_argument("--seq", type=int, at_least=1, help="sequence length (default: the model's context)")
    w.add_argument("--dtype", default="bf16", choices=["fp32", "fp16", "bf16", "fp8"])
    c = p.add_argument_group("constraints (comma-separated values to search; default: syntorch/plan/space.py's)")
    for dim, meaning in (("tp", "tensor parallel (default: divisors of --gpus_per_node)"),
                         ("pp", "pipeline stages (default: divisors of --gpus up to the layers)"),
                         ("cp", "context parallel (default: 1, 2, ... while each rank keeps >= 4,096 tokens)"),
                         ("ep", "expert parallel, MoE models (default: divisors of the experts)"),
                         ("etp", "the experts' own tensor parallel, MoE models (default: 1 and --tp)"),
                         ("dp", "data parallel, what TP x PP x CP leave of --gpus (default: any)"),
                         ("virtual_stages", "interleaved 1F1B chunks per stage (default: 1-4)"),
                         ("micro_batch_size", "sequences per micro-batch (default: 1, 2, 4, 8, 16)")):
        c.add_argument(f"--{dim}", type=ints(1), help=meaning)
    c.add_argument("--zero", type=ints(0), help="0 DDP, 1 distributed optimizer, 2, 3 FSDP (default: 0, 1, 3)")
    c.add_argument("--sp", default="true", choices=["true", "false", "both"],
                   help="sequence parallel with TP > 1 (default true)")
    c.add_argument("--recompute", type=recomputes, help="none, selective, full (default: all three)")
    c.add_argument("--no_recompute", action="store_true", help="--recompute none")
    c.add_argument("--all_recompute", action="store_true", help="also predict layouts that recompute more than "
                   "they need to fit (never faster; by default only the least recomputation that fits)")
    c.add_argument("--max_memory_gb", type=float, above=0, help="memory per rank allowed (default: the device's)")
    o = p.add_argument_group("prediction and outputs")
    o.add_argument("--profile", default="fused",
                   help="software profile of the durations: fused (Megatron's kernels, the default) or eager")
    add_attention(o)
    o.add_argument("--workers", type=int, at_least=1, help="local worker processes (default: the cores)")
    o.add_argument("--ray", type=named, metavar="ADDRESS", help="run the predictions as Ray tasks on this cluster "
                   "(auto: the running one); needs pip install -e '.[cluster]'")
    o.add_argument("--top", type=int, default=10, at_least=1, help="layouts in the table (default 10)")
    o.add_argument("--emit", type=int, default=0, at_least=0, help="write the top K layouts' `syntorch trace` "
                   "folders (Chakra .et per rank) into --out")
    o.add_argument("--out", default="runs/plan", help="output folder")
    o.add_argument("--force", action="store_true", help="replace the outputs of an earlier syntorch run in --out")
    o.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def ints(least: int):
    def parse(text: str) -> tuple:
        try:
            values = tuple(int(x) for x in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if any(v < least or v >= 2**63 for v in values):
            raise argparse.ArgumentTypeError(f"values must be at least {least}, got {text!r}")
        return values
    return parse


def recomputes(text: str) -> tuple:
    values = tuple(text.split(","))
    if not set(values) <= {"none", "selective", "full"}:
        raise argparse.ArgumentTypeError(f"expected none, selective or full (comma-separated), got {text!r}")
    return values


def names(text: str) -> tuple:
    values = tuple(x.strip() for x in text.split(","))
    if not all(values):
        raise argparse.ArgumentTypeError(f"expected comma-separated presets or files, got {text!r}")
    return values


def run(args) -> int:
    import dataclasses

    from syntorch.checkpoints import resolve_model_config
    from syntorch.console import console
    from syntorch.errors import UserError
    from syntorch.hardware import load_hw_config
    from syntorch.outdir import atomic_output_dir, check_output_dir
    from syntorch.plan import report
    from syntorch.plan.emit import emit
    from syntorch.plan.runner import default_workers
    from syntorch.plan.search import search
    from syntorch.plan.space import Choices, Work
    from syntorch.trace.cost import check_attention, check_profile

    check_output_dir(args.out, args.force, "--out", new_files=OUTPUTS)  # before the work, not after it
    if bool(args.hw_config) == bool(args.compare_hw):
        raise UserError("give the machine as --hw_config NAME|FILE, or several as --compare_hw A,B (one of them)")
    check_profile(args.profile)
    check_attention(args.attention)
    config = resolve_model_config(args.model, args.model_config)
    seq = args.seq or config.n_positions
    if args.tokens_per_step and args.tokens_per_step % seq:
        raise UserError(f"--tokens_per_step {args.tokens_per_step} is not a whole number of --seq {seq} sequences; "
                        f"use {max(1, args.tokens_per_step // seq) * seq}")
    hws = [load_hw_config(name) for name in (args.compare_hw or [args.hw_config])]
    per_node = args.gpus_per_node or hws[0].devices_per_node
    hws = [dataclasses.replace(hw, devices_per_node=per_node) for hw in hws]
    work = Work(args.gpus, args.global_batch or args.tokens_per_step // seq, seq, per_node)
    choices = Choices(tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, etp=args.etp, dp=args.dp,
                      virtual_stages=args.virtual_stages, micro_batch_size=args.micro_batch_size, zero=args.zero,
                      sp={"true": (True,), "false": (False,), "both": (False, True)}[args.sp],
                      recompute=("none",) if args.no_recompute else args.recompute)
    result = search(config, work, choices, hws, args.dtype, args.max_memory_gb, args.profile, args.attention,
                    args.workers or default_workers(), args.ray, not args.no_progress, args.all_recompute)
    if not result.rows and result.refused:
        first = result.refused[0]
        raise UserError(f"no layout could be predicted: all {len(result.refused):,} were refused, e.g. "
                        f"{first['name']}: {first['reason']}")
    out = console()
    out.print(report.pruning_line(result), highlight=False)
    out.print(report.compare_table(result, min(args.top, 5)) if len(hws) > 1 else report.table(result, args.top))
    inputs = {k: v for k, v in vars(args).items() if k != "func"}
    with atomic_output_dir(args.out, args.force, "--out") as tmp:
        report.write_csv(result, tmp / "plans.csv")
        report.write_json(result, tmp / "plans.json", inputs)
        report.write_png(result, tmp / "plans.png", limit_gb=args.max_memory_gb)
        emitted = emit(result, args.emit, tmp, args.dtype, args.profile, args.attention, not args.no_progress)
    out.print(f"{len(result.rows):,} layouts -> {args.out}/plans.csv, plans.json, plans.png"
              + "".join(f"\n  trace of #{i + 1}: {args.out}/{name} (syntorch validate it; ASTRA-sim takes it)"
                        for i, name in enumerate(emitted)), highlight=False)
    return 0
