"""`syntorch infer`: GPT-3 (or any registry model) inference, optionally traced. Seed 000's options as spelled there."""
import argparse



def int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,3, got {text!r}") from None


def add_parser(sub) -> None:
    p = sub.add_parser("infer", help="run inference (prefill + decode with a KV cache), optionally traced")
    m = p.add_argument_group("model")
    m.add_argument("--model", default="gpt3-125m", help="registry name (gpt2, gpt3-125m … gpt3-175b, gptj-6b, bert-…)")
    m.add_argument("--model_config", help="JSON file of ModelConfig fields that override --model (or define a model)")
    m.add_argument("--checkpoint", help="HuggingFace model folder (config.json + model.safetensors or pytorch_model.bin)")
    m.add_argument("--device", default="cpu", help="cpu, cuda or meta (symbolic: no memory, no real numbers)")
    m.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    g = p.add_argument_group("generation")
    g.add_argument("--num_input_tokens", type=int, default=10, help="prompt length when ids are drawn at random")
    g.add_argument("--num_output_tokens", type=int, default=20)
    g.add_argument("--batch_size", type=int, default=1)
    g.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    g.add_argument("--top_k", type=int, default=0, help="keep the k most likely tokens (0: off, 1: greedy)")
    g.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--beam_width", type=int, default=1)
    g.add_argument("--stop_tokens", type=int_list, default=[], help="token ids that end a sequence, e.g. 50256")
    g.add_argument("--input_ids", type=int_list, help="prompt token ids, e.g. 1,2,3")
    g.add_argument("--prompt", help="prompt text (needs --tokenizer)")
    g.add_argument("--tokenizer", help="local HuggingFace tokenizer folder")
    par = p.add_argument_group("parallelism")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (real ranks on cpu/cuda, symbolic on meta)")
    par.add_argument("--sp", action="store_true", help="sequence parallel (with --tp > 1)")
    out = p.add_argument_group("outputs")
    out.add_argument("--out", default="runs/infer", help="output folder (run.json, traces, images)")
    out.add_argument("--force", action="store_true", help="replace the outputs of an earlier syntorch run in --out")
    out.add_argument("--visualize_trace", action="store_true", help="write tensor_trace_graph.png/.json")
    out.add_argument("--trace_level", choices=["op", "module", "layer"], default=None,
                     help="graph level for images and exports (default: op, or coarser when too big to draw)")
    out.add_argument("--hw_config", help="hardware preset (a100-80gb, h100-sxm, h200-sxm, cpu) or JSON file")
    out.add_argument("--chakra", action="store_true", help="write Chakra .et traces per rank into OUT/chakra")
    out.add_argument("--comm_debug", type=int, nargs="?", const=1, default=None, metavar="NOISE_LEVEL",
                     help="collective report (table, log, JSON, HTML) at noise level 0-3 (default 1)")
    p.set_defaults(func=run)


def spec_from_args(args):
    from syntorch.inference import InferenceSpec
    return InferenceSpec(
        model=args.model, model_config=args.model_config, checkpoint=args.checkpoint, device=args.device,
        dtype=args.dtype, num_input_tokens=args.num_input_tokens, num_output_tokens=args.num_output_tokens,
        batch_size=args.batch_size, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, beam_width=args.beam_width, stop_tokens=args.stop_tokens, input_ids=args.input_ids,
        prompt=args.prompt, tokenizer=args.tokenizer, tp=args.tp, sp=args.sp)


def run(args) -> int:
    from syntorch import inference
    from syntorch.export.run_outputs import write_run_outputs
    from syntorch.outdir import atomic_output_dir

    spec = spec_from_args(args)
    spec.check()
    inference.sampling_of(spec)  # validates temperature/top_k/top_p before any work is done
    config = inference.resolve_config(spec)
    prompt = inference.make_prompt(spec, config)
    outputs = outputs_from_args(args)
    outputs.check()
    if spec.tp > 1:
        return run_tensor_parallel(spec, args, outputs)
    with atomic_output_dir(args.out, args.force, "--out") as tmp:
        model = inference.load_model(spec, config)
        if outputs.any:
            traces, result = trace_generation(spec, model, prompt)
        else:
            result = inference.generate_tokens(spec, model, prompt)
        record = inference.run_record(spec, config, prompt, result)
        if outputs.any:
            record["trace"] = write_run_outputs(traces, tmp, outputs)
        inference.write_run_json(record, tmp)
    print_result(record, args.out)
    return 0


def outputs_from_args(args):
    from syntorch.export.run_outputs import RunOutputs
    return RunOutputs(visualize=args.visualize_trace, chakra=args.chakra, hw_config=args.hw_config,
                      comm_debug=args.comm_debug, level=args.trace_level)


def run_tensor_parallel(spec, args, outputs) -> int:
    """--tp > 1: real ranks (spawned here, or torchrun's) on cpu/cuda; on meta one symbolic trace of rank 0
    stands for every rank. Rank 0 writes run.json and the outputs asked for (write_run_outputs)."""
    import contextlib
    import os

    import torch

    from syntorch.outdir import atomic_output_dir
    from syntorch.parallel.symbolic import run_tp_symbolic
    from syntorch.parallel.tensor import run_tp_inference

    run_tp = run_tp_symbolic if torch.device(spec.device).type == "meta" else run_tp_inference
    writer = os.environ.get("RANK", "0") == "0"  # torchrun's other ranks write nothing: rank 0 owns --out
    with atomic_output_dir(args.out, args.force, "--out") if writer else contextlib.nullcontext(args.out) as tmp:
        record = run_tp(spec, tmp, outputs)
    if record is not None:  # None on torchrun's other ranks
        print_result(record, args.out)
    return 0


def trace_generation(spec, model, prompt):
    """Generate under the tracer; returns (one-rank RankTraces, generation result)."""
    from syntorch import inference
    from syntorch.trace import RankTraces, trace_run

    graph, result = trace_run(model, lambda m, scope: inference.generate_tokens(spec, m, prompt, phase_scope=scope))
    traces = RankTraces(1)
    traces.put_shared([0], lambda: graph)
    return traces, result


def print_result(record: dict, out_dir) -> None:
    from rich.console import Console
    console = Console()
    prompt_len = len(record["input_ids"][0])
    for i, ids in enumerate(record["output_ids"]):
        console.print(f"[bold]sequence {i}[/bold] ({prompt_len} prompt tokens) generated: {ids[prompt_len:]}")
        if "output_text" in record:
            console.print(f"  text: {record['output_text'][i]!r}")
    console.print(f"prefill {record['prefill_ms']:.1f} ms, decode {record['decode_ms_per_token']:.1f} ms/token, "
                  f"{record['tokens_per_s']:.1f} tokens/s -> {out_dir}/run.json")
