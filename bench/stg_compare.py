"""The Symbolic Tensor Graph generator (astra-sim/symbolic_tensor_graph, "STG": the trace generator used with
ASTRA-sim) run on bench/train_trace_scale.py's cases, measured the same way as `syntorch trace`, side by side.

Install: git clone https://github.com/astra-sim/symbolic_tensor_graph DIR; pip install sympy pandas graphviz
protobuf (its README's conda packages); then pass --stg DIR or set STG_DIR.

How a case maps onto STG's main.py: the model's shapes from syntorch's registry (--dmodel --dff --head
--kvhead --num_stacks --dvocal, --experts --kexperts for MoE); --tp --pp as given; STG's --sp is context
parallelism (our --cp) and Megatron's sequence parallelism is its --tpsp; its --batch is global and
--micro_batch a global micro-batch, so one sequence per DP replica and micro-batch is --micro_batch DP and
--batch DP x micro-batches. Its ranks are dp x tp x pp x cp x ep, EP beside DP, where ours (Megatron-Core's
order) has EP inside DP: it gets --dp DP / EP so both write the same number of ranks. STG has no ZeRO-1:
--weight_sharded false (plain data parallel), as close as it comes. GPT-3 runs as its "gpt" model, dense
Llama as "llama", Mixtral as "moe" (which always uses --tpsp).

STG's "moe" model fails at 3a7f49c whatever the arguments: main.py renames Batch to MicroBatch again after
MicroBatchReplicator already has, and ReplicateGraph renames by text inside CUSTOM ops' formulas, so the
attention kernel's "(MicroBatch)" becomes "(Micro(MicroBatch))", a call of an undefined function Micro that
its Chakra conversion cannot evaluate. The bench prints that cause in one line instead of STG's row. (With that
second rename deleted, in a copy, Mixtral runs: 64 ranks, 27-31 CPU s on the machine of 2026-11-27.)

    python bench/stg_compare.py --stg DIR [--cases 256x1,...]   # both tools, module level
"""
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

INSTALL = ("git clone https://github.com/astra-sim/symbolic_tensor_graph DIR && pip install sympy pandas graphviz "
           "protobuf; then pass --stg DIR or set STG_DIR")


def stg_missing(stg_dir) -> str:
    """Why STG cannot run from `stg_dir` ("" when it can)."""
    if stg_dir is None:
        return INSTALL
    if not (Path(stg_dir) / "main.py").is_file():
        return f"no main.py in {stg_dir}; {INSTALL}"
    absent = [m for m in ("sympy", "pandas", "graphviz", "google.protobuf") if importlib.util.find_spec(m) is None]
    return f"pip install {' '.join(absent)}" if absent else ""


def stg_args(case, out: Path) -> list[str]:
    from syntorch.config import get_config
    c = get_config(case.model)
    experts = getattr(c, "n_experts", 0)
    kind = "gpt" if not getattr(c, "gated_mlp", False) else "moe" if experts else "llama"
    dff = (getattr(c, "d_ff_expert", 0) if experts else 0) or c.d_ff or 4 * c.d_model
    moe = ["--experts", str(experts), "--kexperts", str(c.moe_top_k)] if experts else []
    return ["main.py", "--output_dir", str(out), "--output_name", f"{case.model}.%d.et", "--model_type", kind,
            "--dp", str(case.dp // case.ep), "--tp", str(case.tp), "--pp", str(case.pp), "--sp", str(case.cp),
            "--ep", str(case.ep), "--tpsp", str(case.sp or bool(experts)).lower(), "--weight_sharded", "false",
            "--dvocal", str(c.vocab_size), "--dmodel", str(c.d_model), "--dff", str(dff),
            "--head", str(c.n_head), "--kvhead", str(getattr(c, "n_kv_head", 0) or c.n_head),
            "--num_stacks", str(c.n_layer), "--seq", str(case.seq), "--batch", str(case.dp * case.microbatches),
            "--micro_batch", str(case.dp), *moe]


MOE_BUG = ("STG's moe model fails on any input: main.py renames Batch to MicroBatch twice, which turns the "
           "attention kernel's formula into Micro(MicroBatch), an undefined function its Chakra conversion cannot "
           "evaluate (TypeError: Cannot convert expression to float)")


def run_stg(case, stg_dir) -> dict:
    """STG's measurement of `case`; a RuntimeError with one line saying why when STG fails."""
    from train_trace_scale import measure
    out = Path(tempfile.mkdtemp(prefix="stg_compare.")) / "trace"
    cmd = stg_args(case, out)
    try:
        return measure([sys.executable, *cmd], out, cwd=stg_dir)
    except RuntimeError as e:
        known = "Cannot convert expression to float" in str(e) and cmd[cmd.index("--model_type") + 1] == "moe"
        raise RuntimeError(MOE_BUG if known else f"STG failed: {str(e).splitlines()[-1]}") from None
    finally:
        shutil.rmtree(out.parent)


def main():
    import argparse

    from train_trace_scale import CASES, missing, row, run_syntorch
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stg", default=os.environ.get("STG_DIR"), help="a checkout of symbolic_tensor_graph ($STG_DIR)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    args = p.parse_args()
    if why := stg_missing(args.stg):
        print(f"STG not installed: {why}")
        return
    print(f"{'case':10} {'tool':8} {'level':6} {'ranks':>6} {'wall s':>8} {'CPU s':>8} {'sys s':>6} {'RSS MB':>7} "
          f"{'MB':>9} {'rank KB':>8}  STG/syntorch (wall, CPU)")
    for name in args.cases.split(","):
        case = CASES[name]
        if needs := missing(case):
            print(f"{name:10} needs {' and '.join(needs)} (the model's shapes come from syntorch's registry)")
            continue
        ours = run_syntorch(case, "module", validate=False)
        print(row("syntorch", name, "module", ours), flush=True)
        try:
            theirs = run_stg(case, args.stg)
        except RuntimeError as e:
            print(f"{name:10} STG      {e}", flush=True)
            continue
        print(row("STG", name, "STG", theirs) + f"  {theirs['wall_s'] / ours['wall_s']:.1f}x, "
              f"{theirs['cpu_s'] / ours['cpu_s']:.1f}x", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
