"""What `syntorch plan` shows and writes: the ranked table (or, for several machines, their best layouts side
by side), `plans.csv` and `plans.json` with every evaluated layout, and `plans.png`: predicted step against
memory per rank, the Pareto front (no other layout both faster and smaller) marked, the top layouts labelled.
"""
import csv
import json
from pathlib import Path

from rich.table import Table

from syntorch.plan.search import Result
from syntorch.plan.space import RULES

CSV_FIELDS = ("hw", "rank", "name", "tp", "pp", "dp", "cp", "ep", "etp", "vp", "sp", "zero", "recompute", "mbs",
              "microbatches", "layers", "step_s", "tokens_per_s_per_gpu", "mfu", "memory_gb", "bubble_fraction",
              "exposed_comm_s")
COLUMNS = (("#", "rank", "{}"), ("layout", "name", "{}"), ("layers", "layers", "{}"), ("µbatches", "microbatches", "{}"),
           ("step s", "step_s", "{:.4g}"), ("tok/s/GPU", "tokens_per_s_per_gpu", "{:,.0f}"), ("MFU", "mfu", "{:.1%}"),
           ("GB/rank", "memory_gb", "{:.1f}"), ("bubble", "bubble_fraction", "{:.1%}"),
           ("exposed comm s", "exposed_comm_s", "{:.3f}"))


def pruning_line(result: Result) -> str:
    """"1,287 layouts: 945 pruned by 'pp x virtual stages split the layers', ...; 733 predicted"."""
    parts = []
    for rule in RULES:
        n = result.pruned.get(rule) or 0
        total = sum(n.values()) if isinstance(n, dict) else n
        if total:
            many = isinstance(n, dict) and len(n) > 1
            where = ", ".join(f"{k:,} on {hw}" for hw, k in n.items()) if many else f"{total:,}"
            parts.append(f"{where} by '{RULES[rule]}'")
    refused = f", {len(result.refused)} refused by the prediction" if result.refused else ""
    return (f"{result.enumerated:,} layouts; pruned {'; '.join(parts) or 'none'}; {len(result.rows):,} predicted "
            f"from {result.probes:,} probe sets{refused}")


def table(result: Result, top: int) -> Table:
    hw = result.hws[0]
    work = result.work
    t = Table(title=f"{result.config.name} on {work.gpus:,} x {hw.name}: {work.global_batch:,} sequences x "
                    f"{work.seq:,} tokens per step, fastest {min(top, len(result.rows))} of {len(result.rows):,}")
    for header, _, _ in COLUMNS:
        t.add_column(header, justify="left" if header == "layout" else "right")
    for row in result.best(hw.name, top):
        t.add_row(*(cell(fmt, row[key]) for _, key, fmt in COLUMNS))
    return t


def cell(fmt: str, value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        value = value + 0.0 if abs(value) > 1e-12 else 0.0  # no "-0.0%" for a bubble rounded below zero
    return fmt.format(value)


def compare_table(result: Result, top: int) -> Table:
    """The best `top` layouts of each machine side by side."""
    t = Table(title=f"{result.config.name} on {result.work.gpus:,} GPUs: the fastest layouts per machine")
    t.add_column("#", justify="right")
    for hw in result.hws:
        t.add_column(hw.name)
    best = {hw.name: result.best(hw.name, top) for hw in result.hws}
    for i in range(top):
        cells = []
        for hw in result.hws:
            rows = best[hw.name]
            cells.append(f"{rows[i]['name']}\n{rows[i]['step_s']:.4g} s, {rows[i]['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, "
                         f"MFU {cell('{:.1%}', rows[i]['mfu'])}, {rows[i]['memory_gb']:.1f} GB" if i < len(rows) else "-")
        t.add_row(str(i + 1), *cells)
    firsts = [best[hw.name][0]["step_s"] for hw in result.hws if best[hw.name]]
    if len(firsts) == len(result.hws):
        t.caption = "best step: " + ", ".join(f"{hw.name} {step:.4g} s ({firsts[0] / step:.2f}x)"
                                              for hw, step in zip(result.hws, firsts))
    return t


def write_csv(result: Result, path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result.rows)


def write_json(result: Result, path: Path, inputs: dict) -> None:
    record = {"model": result.config.name, "inputs": inputs, "enumerated": result.enumerated,
              "pruned": {RULES[rule]: n for rule, n in result.pruned.items()}, "probe_sets": result.probes,
              "hw_configs": [hw.to_dict() for hw in result.hws], "layouts": result.rows, "refused": result.refused}
    path.write_text(json.dumps(record, indent=1))


def pareto(rows: list[dict]) -> list[dict]:
    """The rows no other row beats on both step and memory, by memory."""
    front, best = [], float("inf")
    for row in sorted(rows, key=lambda r: (r["memory_gb"], r["step_s"])):
        if row["step_s"] < best:
            front.append(row)
            best = row["step_s"]
    return front


def write_png(result: Result, path: Path, labelled: int = 5, limit_gb: float | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import FormatStrFormatter, ScalarFormatter

    fig = Figure(figsize=(9, 6), dpi=120)
    ax = fig.add_subplot()
    for color, hw in zip(("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown"), result.hws):
        rows = [r for r in result.rows if r["hw"] == hw.name]
        if not rows:
            continue
        ax.scatter([r["memory_gb"] for r in rows], [r["step_s"] for r in rows], s=10, alpha=0.35, color=color,
                   label=f"{hw.name}: {len(rows):,} layouts")
        front = pareto(rows)
        ax.plot([r["memory_gb"] for r in front], [r["step_s"] for r in front], "-o", ms=4, lw=1.2, color=color,
                drawstyle="steps-post", label=f"{hw.name}: Pareto front (none both faster and smaller)")
        middle = (min(r["memory_gb"] for r in rows) + max(r["memory_gb"] for r in rows)) / 2
        for row in rows[:labelled if hw is result.hws[0] else 1]:  # more would overlap the first's labels
            left = row["memory_gb"] > middle  # labels point inwards, so none runs off the figure
            ax.annotate(f"{row['rank']}. {row['name']}", (row["memory_gb"], row["step_s"]), fontsize=7,
                        xytext=(-40 if left else 40, 8 + 10 * (row["rank"] - 1)), textcoords="offset points",
                        ha="right" if left else "left", color=color,
                        arrowprops=dict(arrowstyle="-", lw=0.5, color=color))
        limit = limit_gb or hw.memory_gb
        if limit <= 2 * max(r["memory_gb"] for r in rows):  # a line far right would squash the points
            ax.axvline(limit, color=color, lw=0.8, ls="--", label=f"{hw.name}: {limit:g} GB per rank")
    ax.set(xlabel="estimated peak memory per rank (GB)", ylabel="predicted step (s)", yscale="log")
    # plain numbers on the log axis (matplotlib writes minor ticks as 1.5 x 10^-1 otherwise)
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
    work = result.work
    ax.set_title(f"{result.config.name}, {work.gpus:,} GPUs, {work.global_batch:,} x {work.seq:,} tokens per step",
                 fontsize=10)
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
