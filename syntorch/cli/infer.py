"""`syntorch infer`: GPT-3 (or any registry model) inference, optionally traced. Seed 000's options as spelled there.
A decoder generates; an encoder (BERT) predicts its masked tokens in one pass (syntorch/fill_mask.py)."""
import argparse



def int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,3, got {text!r}") from None


def add_parser(sub) -> None:
    from syntorch.cli.predict import add_attention, add_model
    from syntorch.options import named

    p = sub.add_parser("infer", help="run inference (prefill + decode with a KV cache; BERT: one pass "
                                      "predicting masked tokens), optionally traced")
    m = p.add_argument_group("model")
    add_model(m)
    m.add_argument("--checkpoint", help="HuggingFace model folder (config.json + model.safetensors or pytorch_model.bin), "
                   "or a folder written by syntorch shard for this --tp")
    m.add_argument("--device", default="cpu", help="cpu, cuda or meta (symbolic: no memory, no real numbers)")
    m.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16", "fp8"],
                   help="fp8: Linear GEMMs in FP8 as Transformer Engine runs them, the rest in bf16 (needs an FP8 GPU)")
    m.add_argument("--quant", choices=["int8_weight_only"], default=None,
                   help="int8 weights with one scale per output channel, dequantized in the matmul (cpu, meta)")
    m.add_argument("--quant_head", action="store_true", help="with --quant: quantize the LM head too")
    g = p.add_argument_group("generation")
    g.add_argument("--num_input_tokens", type=int, default=10, help="prompt length when ids are drawn at random")
    # default None, not 20: an encoder refuses the option only when it is given
    g.add_argument("--num_output_tokens", type=int, default=None,
                   help="tokens to generate (default 20; decoders only: an encoder predicts masked tokens)")
    g.add_argument("--batch_size", type=int, default=1)
    g.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    g.add_argument("--top_k", type=int, default=0, help="keep the k most likely tokens (0: off, 1: greedy)")
    g.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--beam_width", type=int, default=1)
    g.add_argument("--stop_tokens", type=int_list, default=[], help="token ids that end a sequence, e.g. 50256")
    g.add_argument("--input_ids", type=int_list, action="append",
                   help="prompt token ids, e.g. 1,2,3; repeat for a batch of prompts (lengths may differ)")
    g.add_argument("--prompt", action="append",
                   help="prompt text (needs --tokenizer), repeatable; for BERT, [MASK] marks what to predict")
    g.add_argument("--prompt_file", help="text file of prompts, one per line (needs --tokenizer)")
    g.add_argument("--tokenizer", help="local HuggingFace tokenizer folder")
    par = p.add_argument_group("parallelism")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (real ranks on cpu/cuda, symbolic on meta)")
    par.add_argument("--sp", action="store_true", help="sequence parallel (with --tp > 1)")
    par.add_argument("--pp", type=int, default=1,
                     help="pipeline-parallel degree: contiguous layer stages, the batch in micro-batches (FasterTransformer's rule)")
    out = p.add_argument_group("outputs")
    out.add_argument("--out", default="runs/infer", help="output folder (run.json, traces, images)")
    out.add_argument("--force", action="store_true", help="replace the outputs of an earlier syntorch run in --out")
    out.add_argument("--visualize_trace", action="store_true", help="write tensor_trace_graph.png/.json")
    out.add_argument("--trace_level", choices=["op", "module", "layer"], default=None,
                     help="graph level for images and exports (default: op, or coarser when too big to draw)")
    out.add_argument("--hw_config", type=named, help="hardware preset (a100-80gb, h100-sxm, h200-sxm, cpu) or JSON file")
    out.add_argument("--profile", default="eager",
                     help="software profile of the predicted durations: eager (one kernel per aten op, as PyTorch "
                          "runs) or fused (FasterTransformer/Megatron kernels)")
    add_attention(out)
    out.add_argument("--recompute", default="none", help="training only (syntorch trace); inference recomputes nothing")
    out.add_argument("--chakra", action="store_true", help="write Chakra .et traces per rank into OUT/chakra")
    out.add_argument("--comm_debug", type=int, nargs="?", const=1, default=None, metavar="NOISE_LEVEL",
                     help="collective report (table, log, JSON, HTML) at noise level 0-3 (default 1)")
    p.set_defaults(func=run)


def run(args) -> int:
    from syntorch.config import from_args
    from syntorch.inference import InferenceSpec, RunOutputs, run_inference

    from syntorch.parallel.recompute import check_recompute
    from syntorch.trace.cost import check_profile_needs_hw

    check_recompute(args.recompute, mode="infer")
    check_profile_needs_hw(args.profile, args.hw_config, args.attention)
    outputs = from_args(RunOutputs, args, visualize=args.visualize_trace, level=args.trace_level)
    if args.dtype == "fp8" and args.hw_config:
        from syntorch.hardware import load_hw_config
        from syntorch.parallel.fp8 import check_fp8
        check_fp8(load_hw_config(args.hw_config))
    record = run_inference(from_args(InferenceSpec, args), args.out, outputs, force=args.force)
    if record is not None:  # None on torchrun's other ranks
        print_result(record, args.out)
    return 0


def print_result(record: dict, out_dir) -> None:
    from syntorch.console import console as make_console
    console = make_console()
    if record.get("symbolic"):
        _print_symbolic(console, record, out_dir)
    elif "predictions" in record:
        _print_predictions(console, record, out_dir)
    else:
        _print_generated(console, record, out_dir)


def _print_symbolic(console, record: dict, out_dir) -> None:
    predicted = record.get("predicted")
    latency = (f"predicted latency {predicted['latency_ms']:.1f} ms on {predicted['hw_config']} (prefill "
               f"{predicted['prefill_ms']:.1f} ms, decode {predicted['decode_ms_per_token']:.2f} ms/token)" if predicted else
               "no values on meta; give --hw_config for a predicted latency")
    if "positions" in record:  # an encoder
        n = len(record["positions"][0])
        traced = "one encode pass traced, predicting " + (
            f"the {n} masked positions" if record["predicted_positions"] == "masked" else
            f"all {n} positions (no mask token in the prompt)")
    else:
        traced = f"{record['output_tokens_traced']} output tokens traced"
    console.print(f"symbolic run: {max(map(len, record['input_ids']))} prompt tokens, {traced}; {latency} "
                  f"-> {out_dir}/run.json")


def _print_generated(console, record: dict, out_dir) -> None:
    for i, ids in enumerate(record["output_ids"]):
        prompt_len = len(record["input_ids"][i])
        console.print(f"[bold]sequence {i}[/bold] ({prompt_len} prompt tokens) generated: {ids[prompt_len:]}")
        if "output_text" in record:
            console.print(f"  text: {record['output_text'][i]!r}")
    console.print(f"prefill {record['prefill_ms']:.1f} ms, decode {record['decode_ms_per_token']:.1f} ms/token, "
                  f"{record['tokens_per_s']:.1f} tokens/s -> {out_dir}/run.json")


PRINTED_POSITIONS = 8  # per sequence; run.json holds them all


def _print_predictions(console, record: dict, out_dir) -> None:
    from rich.markup import escape  # tokens such as [unused0] must print as they are
    what = (f"masked positions (token id {record['mask_token_id']})" if record["predicted_positions"] == "masked"
            else f"every position (no mask token, id {record['mask_token_id']}, in the prompt)")
    for i, row in enumerate(record["predictions"]):
        console.print(f"[bold]sequence {i}[/bold] ({len(record['input_ids'][i])} prompt tokens): "
                      f"top {len(row[0]['ids'])} predictions at {what}")
        for p in row[:PRINTED_POSITIONS]:
            names = p.get("tokens", p["ids"])
            console.print(f"  position {p['position']}: "
                          + ", ".join(f"{escape(str(n))} {prob:.3g}" for n, prob in zip(names, p["probs"])))
        if len(row) > PRINTED_POSITIONS:
            console.print(f"  … {len(row) - PRINTED_POSITIONS} more positions in run.json")
        if "filled_text" in record:
            console.print(f"  filled: {escape(repr(record['filled_text'][i]))}")
    console.print(f"encode {record['encode_ms']:.1f} ms (one pass) -> {out_dir}/run.json")
