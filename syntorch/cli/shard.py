"""`syntorch shard --checkpoint HF_DIR --tp N --pp M --out DIR`: a HuggingFace folder cut into one safetensors
file per rank (FasterTransformer's `gptj_ckpt_convert.py --n-inference-gpus N`), which
`syntorch infer --checkpoint DIR --tp N` then loads rank by rank (syntorch/shard_files.py). `--merge`: a shard folder
(from here or `syntorch train --save-format sharded`) put back together as one HuggingFace folder."""
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("shard", help="cut a HuggingFace checkpoint into one file per TP/PP rank")
    p.add_argument("--checkpoint", "--ckpt-dir", dest="checkpoint", required=True,
                   help="HuggingFace model folder (config.json + model.safetensors or pytorch_model.bin)")
    p.add_argument("--tp", "--n-inference-gpus", dest="tp", type=int, default=1, at_least=1,
                   help="tensor-parallel degree the shards are for")
    p.add_argument("--pp", type=int, default=1, at_least=1, help="pipeline stages the shards are for")
    p.add_argument("--out", "--output-dir", dest="out", required=True, help="folder to write (rank files + index)")
    p.add_argument("--merge", action="store_true", help="--checkpoint is a shard folder: write it back as one "
                   "HuggingFace folder (config.json + model.safetensors, and its tokenizer files)")
    p.add_argument("--force", action="store_true", help="replace an earlier syntorch shard folder in --out")
    p.set_defaults(func=run)


def run(args) -> int:
    from syntorch.parallel.mesh import Mesh
    from syntorch.shard_files import write_shards

    if args.merge:
        return merge(args)
    index = write_shards(args.checkpoint, args.out, args.tp, args.pp, force=args.force)
    mesh = Mesh(pp=args.pp, tp=args.tp)
    for rank, name in sorted(index.files.items()):
        first, stop = index.layers[rank]
        place = mesh.coordinate(rank)
        print(f"rank {rank} (stage {place.pp}, tp rank {place.tp}): layers {first}..{stop - 1}, "
              f"{len(index.tensors[rank])} tensors -> {args.out}/{name}")
    return 0


def merge(args) -> int:
    from syntorch.checkpoints import SHARD_INDEX, save_checkpoint
    from syntorch.errors import UserError
    from syntorch.outdir import check_output_dir
    from syntorch.shard_files import loaded, merged_state
    from syntorch.train.squad import TOKENIZER_FILES, LocalTokenizer

    if not (Path(args.checkpoint) / SHARD_INDEX).is_file():
        raise UserError(f"--merge takes a shard folder (with {SHARD_INDEX}); {args.checkpoint} has none")
    if (args.tp, args.pp) != (1, 1):
        raise UserError("--merge writes one whole model; drop --tp/--pp (the shard folder's own are used)")
    check_output_dir(args.out, args.force, "--out", inputs=[args.checkpoint])
    config, state = merged_state(args.checkpoint)
    has_tokenizer = any((Path(args.checkpoint) / name).is_file() for name in TOKENIZER_FILES)
    save_checkpoint(loaded(config, state), args.out, LocalTokenizer(args.checkpoint) if has_tokenizer else None,
                    "--out")
    print(f"{args.checkpoint} ({len(state)} tensors) -> {args.out} (one HuggingFace folder)")
    return 0
