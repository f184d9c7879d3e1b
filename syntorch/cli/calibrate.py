"""`syntorch calibrate`: measure this machine's matmul FLOP/s and memory bandwidth for the `cpu` preset."""


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this CPU (matmul FLOP/s, memory bandwidth) for --hw_config cpu")
    p.add_argument("--output", help="where to save the JSON (default: ~/.cache/syntorch/cpu.json, "
                                    "or $SYNTORCH_CACHE_DIR/cpu.json)")
    p.add_argument("--seconds", type=float, default=1.0, above=0, at_most=3600,
                   help="time spent on each figure (at most an hour)")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from syntorch.hardware import calibrate_and_save, calibrate_cpu

    config, path = calibrate_and_save(Path(args.output) if args.output else None,
                                      lambda: calibrate_cpu(seconds=args.seconds))
    for dtype, tflops in config.peak_tflops.items():
        print(f"matmul {dtype}: {tflops * 1e3:.1f} GFLOP/s")
    print(f"memory bandwidth: {config.memory_bw_gb_s:.1f} GB/s")
    print(f"saved {path}")
    return 0
