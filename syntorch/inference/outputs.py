"""Everything a traced `syntorch infer` run writes, in one place, whatever produced the rank graphs
(one CPU run, real TP ranks or a symbolic trace): durations from --hw_config, the graph JSON and images
(--visualize_trace), per-rank Chakra traces (--chakra, and seed 000's --tp N --visualize_trace), and the
collective report (--comm_debug)."""
from dataclasses import dataclass
from pathlib import Path

from syntorch.export import write_trace_outputs
from syntorch.export.comm_report import write_comm_outputs
from syntorch.hardware import load_hw_config
from syntorch.simulate.prediction import TIMELINE, predict_inference
from syntorch.trace.comm_view import check_noise_level
from syntorch.trace.cost import check_attention, check_profile, fill_rank_durations
from syntorch.trace.generation import StageTraces
from syntorch.trace.graph import no_gc


@dataclass
class RunOutputs:
    visualize: bool = False
    chakra: bool = False
    hw_config: str | None = None  # preset name or JSON file
    comm_debug: int | None = None  # noise level of the report, None: no report
    level: str | None = None  # --trace_level
    profile: str = "eager"  # software profile of the durations (trace/kernels.py): eager | fused
    attention: str = "flash"  # the attention kernel of the durations (trace/kernels.py): flash | unfused

    @property
    def any(self) -> bool:
        return self.visualize or self.chakra or self.hw_config is not None or self.comm_debug is not None

    def __post_init__(self):
        """Reject bad options before any model is built."""
        check_profile(self.profile)
        check_attention(self.attention)
        if self.hw_config is not None:
            load_hw_config(self.hw_config)
        if self.comm_debug is not None:
            check_noise_level(self.comm_debug, "--comm_debug")


def write_run_outputs(traces, out_dir, outputs: RunOutputs) -> dict:
    """Writes the outputs of `traces` (rank -> TraceGraph; ranks may share one graph) into `out_dir`.
    Returns what run.json records about them."""
    with no_gc():  # costs, programs, views and nodes are 10^5 young dicts: the collector would rescan them
        return _write_run_outputs(traces, Path(out_dir), outputs)


def _write_run_outputs(traces, out_dir: Path, outputs: RunOutputs) -> dict:
    graph = traces[0]
    record = {"nodes": len(graph), "flops": graph.total_flops(), "ranks": len(traces)}
    if outputs.hw_config is not None:
        hw = load_hw_config(outputs.hw_config)
        fill_rank_durations(traces, hw, outputs.profile, outputs.attention)
        record.update(hw_config=hw.name, profile=outputs.profile, attention=outputs.attention)
        prediction = predict_inference(traces, hw.name, outputs.profile, outputs.attention)
        record["predicted"] = prediction.summary
        prediction.write_timeline(out_dir / TIMELINE)
    if outputs.visualize:
        record["files"] = write_trace_outputs(graph, out_dir, outputs.level)
    if outputs.chakra or (outputs.visualize and len(traces) > 1):
        level = outputs.level if outputs.level in ("op", "module") else "op"
        chakra = _write_chakra(traces, out_dir / "chakra", level, durations=outputs.hw_config is not None)
        record["chakra"] = {k: chakra[k] for k in ("ranks", "distinct_traces", "nodes", "et_bytes", "notes")}
        record["chakra"].update(dir="chakra", level=level)
    if outputs.comm_debug is not None:
        names = ["comm_debug"]
        write_comm_outputs(graph, out_dir, noise_level=outputs.comm_debug)
        # a pipeline's later stages issue other collectives (the recvs): one report per stage's first rank
        tp, pp = graph.graph.get("tp", 1), graph.graph.get("pp", 1)
        for stage in range(1, pp if len(traces) == tp * pp else 1):
            names.append(f"comm_debug_stage{stage}")
            write_comm_outputs(traces[stage * tp], out_dir, noise_level=outputs.comm_debug, name=names[-1])
        record["comm_debug"] = {"noise_level": outputs.comm_debug,
                                "files": [f"{n}{suffix}" for n in names for suffix in ("_log.txt", ".json", ".html")]}
    return record


def _write_chakra(traces, out_dir: Path, level: str, durations: bool) -> dict:
    """Every rank's Chakra file: a pipeline run's from its stages' representatives, unless a rank's
    collectives took other durations than its representative's (chakra/stage_files.py)."""
    # imported here: protobuf only for a run that writes Chakra
    from syntorch.chakra import stage_files
    if isinstance(traces, StageTraces) and (not durations or stage_files.same_durations(traces)):
        return stage_files.write_stage_chakra(traces, out_dir, level)
    from syntorch.chakra.writer import write_chakra
    return write_chakra(traces, out_dir, level=level)
