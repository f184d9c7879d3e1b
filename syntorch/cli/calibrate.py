"""`syntorch calibrate`: measure this machine's matmul FLOP/s and memory bandwidth for the `cpu` preset."""


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this CPU (matmul FLOP/s, memory bandwidth) for --hw_config cpu")
    p.add_argument("--output", help="where to save the JSON (default: ~/.cache/syntorch/cpu.json, "
                                    "or $SYNTORCH_CACHE_DIR/cpu.json)")
    p.add_argument("--seconds", type=float, default=1.0, help="time spent on each figure")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from syntorch.errors import UserError
    from syntorch.hardware import calibrate_cpu, save_cpu_config

    if args.seconds <= 0:
        raise UserError(f"--seconds must be > 0, got {args.seconds}")
    config = calibrate_cpu(seconds=args.seconds)
    path = save_cpu_config(config, Path(args.output) if args.output else None)
    for dtype, tflops in config.peak_tflops.items():
        print(f"matmul {dtype}: {tflops * 1e3:.1f} GFLOP/s")
    print(f"memory bandwidth: {config.memory_bw_gb_s:.1f} GB/s")
    print(f"saved {path}")
    return 0
