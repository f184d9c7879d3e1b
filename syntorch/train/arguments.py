"""The command line of `syntorch train` and `python -m syntorch.train` (torchrun), with the seed's
spellings (--model-name, --batch-size, --num-gpus, --enable-tracing, ...). Light: no torch import."""
import argparse

from syntorch.options import Parser


def add_arguments(p: Parser) -> None:
    """The options, on a syntorch.options.Parser (whose checks the bounds below need)."""
    p.add_argument("family", choices=("gpt2", "bert"), help="gpt2: causal LM on question + context; "
                   "bert: masked LM on [CLS] question [SEP] context [SEP]")
    p.add_argument("--data", required=True, help="SQuAD v1.1/v2.0 JSON file")
    p.add_argument("--model-name", "--model", dest="model_name",
                   help="registry name (random init; default gpt2 / bert-base-uncased) or a local HuggingFace folder")
    p.add_argument("--model_config", "--model-config", dest="model_config", help="JSON of ModelConfig fields to override")
    p.add_argument("--tokenizer", help="local HuggingFace tokenizer folder (default: the --model-name folder)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    p.add_argument("--nproc", "--num-gpus", dest="nproc", type=int, at_least=1,
                   help="ranks to spawn (default 1); under torchrun the ranks are torchrun's")
    p.add_argument("--batch-size", type=int, default=4, at_least=1,
                   help="rows per data-parallel replica and accumulation step (every TP/PP/CP rank of it reads them)")
    p.add_argument("--learning-rate", type=float, default=5e-5, above=0)
    p.add_argument("--num-epochs", type=int, default=3, at_least=1)
    p.add_argument("--max-steps", type=int, default=0, at_least=0, help="stop after this many optimizer steps (0: all epochs)")
    p.add_argument("--max-seq-length", type=int, at_least=1, help="default: min(512, the model's positions)")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1, at_least=1)
    p.add_argument("--warmup-steps", type=int, default=0, at_least=0)
    p.add_argument("--weight-decay", type=float, default=0.0, at_least=0,
                   help="AdamW decay of every parameter (ZeRO/FSDP shards are flat: biases decay too)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, at_least=0, help="0 turns clipping off")
    p.add_argument("--logging-steps", type=int, default=10, at_least=1)
    p.add_argument("--save-steps", type=int, default=0, at_least=0, help="also save last_model every N steps (0: at the end)")
    p.add_argument("--eval-steps", type=int, default=0, at_least=0, help="evaluate every N steps (0: every epoch)")
    p.add_argument("--eval-fraction", type=float, default=0.1, at_least=0, help="share of --data held out for evaluation")
    p.add_argument("--save-dir", help="best_model/ and last_model/ in HuggingFace format (default checkpoints/<family>)")
    p.add_argument("--save-format", "--save_format", dest="save_format", choices=["hf", "sharded"], default="hf",
                   help="hf: one HuggingFace folder; sharded: one file per TP x PP rank of the plan, as `syntorch "
                        "shard` writes them (`infer --checkpoint` and `train --model-name` load either)")
    p.add_argument("--seed", type=int, default=42, at_least=0)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, above=0, help="gradient bucket size (parallel/buckets.py)")
    # the parallel plan (parallel/plans.py): data parallel over what tp * pp * cp leave of the ranks
    p.add_argument("--tp", type=int, default=1, at_least=1, help="tensor parallel degree")
    p.add_argument("--pp", type=int, default=1, at_least=1, help="pipeline stages")
    p.add_argument("--cp", type=int, default=1, at_least=1, help="context parallel degree (causal models)")
    p.add_argument("--ep", type=int, default=1, at_least=1,
                   help="expert parallel degree (MoE models), carved out of the CP x DP ranks (Megatron-Core's layout)")
    p.add_argument("--etp", type=int, default=None, at_least=1,
                   help="the experts' own tensor-parallel size (Megatron-Core's --expert-tensor-parallel-size); "
                        "divides --tp, default --tp; 1: each expert whole on a rank")
    p.add_argument("--sp", action="store_true", help="sequence parallel (with --tp)")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage (3: FSDP)")
    p.add_argument("--fsdp", action="store_true", help="fully sharded data parallel, as --zero 3")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "bf16"),
                   help="model dtype; fp16/bf16 train with FP32 master weights")
    p.add_argument("--virtual_stages", "--virtual-stages", type=int, default=1, at_least=1,
                   help="interleaved 1F1B: chunks per pipeline stage")
    p.add_argument("--schedule", dest="pp_schedule", default="1f1b", help="pipeline schedule (1f1b, gpipe)")
    p.add_argument("--microbatches", type=int, default=1, at_least=1,
                   help="micro-batches per batch (they flow through the pipeline; --batch-size must divide by it)")
    p.add_argument("--enable-tracing", action="store_true", help="profile and write Chakra traces per rank")
    p.add_argument("--trace-output-dir", default="outputs")
    p.add_argument("--trace-name", help="file prefix (default <family>_<N>rank)")
    p.add_argument("--force", action="store_true", help="replace an earlier syntorch run's traces in --trace-output-dir")
    p.add_argument("--trace-wait-steps", type=int, default=1, at_least=0)
    p.add_argument("--trace-warmup-steps", type=int, default=1, at_least=1,
                   help="profiled steps before the recorded ones (torch 2.13's profiler cannot read back a window "
                        "without one: it fails decoding the events' names)")
    p.add_argument("--trace-active-steps", type=int, default=1, at_least=1)


def options_from_args(args: argparse.Namespace):
    """(TrainOptions, nproc) after checking what can be checked without loading anything (the parser,
    syntorch.options.Parser, has checked each number's own bounds)."""
    import torch

    from syntorch.capture.profile import Schedule
    from syntorch.config import from_args
    from syntorch.errors import UserError
    from syntorch.train.loop import DEFAULT_MODEL, TrainOptions

    if args.eval_fraction >= 1:  # its other bounds, and every other option's, are checked as it is parsed
        raise UserError(f"--eval-fraction must be below 1 (some data must be left to train on), got {args.eval_fraction}")
    if args.trace_name is not None and (args.trace_name in ("", ".", "..") or "/" in args.trace_name):
        raise UserError(f"--trace-name is the prefix of file names in --trace-output-dir (<name>.<rank>.et); "
                        f"give one without '/', got {args.trace_name!r}")
    if args.enable_tracing:
        from syntorch.capture.to_chakra import check_capture_tools
        check_capture_tools()
    opts = from_args(
        TrainOptions, args, model_name=args.model_name or DEFAULT_MODEL[args.family],
        device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
        save_dir=args.save_dir or f"checkpoints/{args.family}", tracing=args.enable_tracing,
        schedule=Schedule(args.trace_wait_steps, args.trace_warmup_steps, args.trace_active_steps))
    return opts, args.nproc
