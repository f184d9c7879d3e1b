"""`syntorch predict DIR`: the step time of Chakra traces already written (ours or converted captures), from a
cross-rank simulation of them: prediction.json and a Perfetto timeline.json in --out."""
import os

PROFILES = ("eager", "fused")
ATTENTION_KERNELS = ("flash", "unfused")  # trace/kernels.py's, named here so parsing imports no torch


def add_model(group) -> None:
    """--model and --model_config, alike in every command that builds a model from the registry."""
    from syntorch.config import REGISTRY

    group.add_argument("--model", default="gpt3-125m", help=f"registry name: {', '.join(REGISTRY)}")
    group.add_argument("--model_config", help="JSON file of ModelConfig fields that override --model (or define a model)")


def add_attention(group, default: str | None = "flash") -> None:
    """--attention, beside --profile in every command that predicts durations."""
    group.add_argument("--attention", default=default, choices=ATTENTION_KERNELS,
                       help="the attention kernel of the predicted durations: flash (one fused kernel, as PyTorch's "
                            "SDPA, Transformer Engine and torchtitan run it; the default) or unfused (QK^T GEMM, "
                            "softmax, GEMM over V with the scores in memory: Megatron-LM 2022, FasterTransformer, "
                            "PyTorch's math path)" + ("" if default else "; default: the files' own, else flash"))


def add_parser(sub) -> None:
    from syntorch.options import named
    p = sub.add_parser("predict", help="simulate Chakra .et traces across ranks: step time, MFU, bubbles, timeline")
    p.add_argument("path", help="folder of <prefix>.<rank>.et files, or the prefix itself")
    p.add_argument("--hw_config", type=named, help="hardware preset (a100-80gb, h100-sxm, h200-sxm, cpu) or JSON file; "
                                       "without it, the files' own duration_micros")
    p.add_argument("--profile", choices=PROFILES, help="software profile of the performance model (needs --hw_config)")
    add_attention(p, default=None)
    p.add_argument("--out", default="runs/predict", help="output folder (prediction.json, timeline.json)")
    p.add_argument("--force", action="store_true", help="replace an earlier syntorch run's outputs in --out")
    p.set_defaults(func=run)


def run(args) -> int:
    from syntorch.errors import UserError
    from syntorch.hardware import load_hw_config
    from syntorch.outdir import check_output_dir
    from syntorch.simulate.chakra_files import predict_traces
    from syntorch.simulate.prediction import write_prediction

    if args.profile and not args.hw_config:
        raise UserError("--profile chooses how the performance model groups ops into kernels; give --hw_config too")
    if args.attention and not args.hw_config:
        raise UserError("--attention chooses the performance model's attention kernel; give --hw_config too")
    read = args.path if os.path.isdir(args.path) else os.path.dirname(args.path) or "."
    check_output_dir(args.out, args.force, "--out", inputs=[read],
                     new_files=["prediction.json", "timeline.json"])  # --force never removes the traces it reads
    hw = load_hw_config(args.hw_config) if args.hw_config else None
    check_simulable(args.path)
    prediction = predict_traces(args.path, hw, args.profile, args.attention)
    write_prediction(args.out, {"predicted": prediction.summary}, prediction, "prediction.json", args.force)
    print_prediction(prediction.summary)
    print(f"-> {args.out}/prediction.json, {args.out}/timeline.json (open in ui.perfetto.dev)")
    return 0


def check_simulable(path) -> None:
    """The validator's rules before any simulation: a cycle, a send without its recv or a group whose
    members disagree would otherwise hang or mislead the simulator, as they would ASTRA-sim."""
    from syntorch.chakra.validator import validate_traces
    from syntorch.errors import UserError

    problems = validate_traces(path)
    if problems:
        more = f" (and {len(problems) - 1} more: run `syntorch validate {path}`)" if len(problems) > 1 else ""
        raise UserError(f"cannot simulate: {problems[0]}{more}")


def print_prediction(predicted: dict) -> None:
    """The step and, per rank kind, where its time went."""
    from rich.table import Table

    from syntorch.console import console as make_console

    head = f"predicted step {predicted['step_s'] * 1e3:.2f} ms"
    if "mfu" in predicted:
        head += f", MFU {predicted['mfu']:.1%}, HFU {predicted['hfu']:.1%}"
    head += f", bubble {predicted['bubble_fraction']:.1%}, exposed comm {predicted['exposed_comm_s'] * 1e3:.2f} ms"
    table = Table(title=head)
    for column in ("rank kind", "ranks", "busy ms", "exposed comm ms", "idle ms"):
        table.add_column(column, justify="right")
    for k in predicted["rank_kinds"]:
        table.add_row(k["kind"], str(k["ranks"]), f"{k['busy_s'] * 1e3:.2f}", f"{k['exposed_comm_s'] * 1e3:.2f}",
                      f"{k['idle_s'] * 1e3:.2f}")
    make_console().print(table)
