"""CommDebugMode: torch's collective-debug API (torch.distributed.tensor.debug.CommDebugMode) on syntorch traces.

    comm_mode = CommDebugMode()
    with comm_mode:
        output = model(inp)
    print(comm_mode.generate_comm_debug_tracing_table(noise_level=0))

Inside the context a syntorch Tracer records the run; everything after is read from its TraceGraph
(trace/comm_view.py's CommReport), so the same report comes from a live run (real gloo/NCCL ranks or the
symbolic fake backend) and from a saved trace (`syntorch comm`). Meanings and noise levels: see CommReport.
"""
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook

from syntorch.export.comm_report import tracing_table, write_html, write_json, write_table
from syntorch.trace.comm_view import CommReport
from syntorch.trace.tracer import Tracer


class CommDebugMode:
    """torch's CommDebugMode on a syntorch Tracer. Pass `model` to name modules from the start; without it the
    first module called inside the context becomes the model, as torch's module tracker finds it."""

    def __init__(self, model=None, meta: dict | None = None):
        self.model = model
        self.meta = meta or {}
        self._tracer = None
        self._root_hook = None
        self._report = None

    def __enter__(self):
        live = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if live else (0, 1)
        self._tracer = Tracer(self.model, rank=rank, world_size=world, meta=self.meta)
        self._report = None
        if self.model is None:
            self._root_hook = register_module_forward_pre_hook(self._adopt_root)
        self._tracer.__enter__()
        return self

    def __exit__(self, *exc):
        self._remove_root_hook()
        self._tracer.__exit__(*exc)
        self._report = self._build_report() if exc[0] is None else None  # never hide the run's own error
        return False

    def _adopt_root(self, module, _args):
        """The first module called is the model: the tracer watches its modules from now on. Its own pre-hook
        was registered too late for this call, so its path ("") is pushed here for its post-hook to pop.
        (Reaches into the tracer: it has no public way yet to start watching a model mid-trace.)"""
        self._remove_root_hook()
        self.model = self._tracer.model = module
        self._tracer._watch_modules(module)
        self._tracer.modules.append("")

    def _remove_root_hook(self):
        if self._root_hook is not None:
            self._root_hook.remove()
            self._root_hook = None

    def phase(self, name: str):
        """Label what runs inside (e.g. "optimizer", "prefill", "decode[0]"); forward and backward are found."""
        return self._tracer.phase(name)

    @property
    def graph(self):
        """The TraceGraph of everything that ran inside the context."""
        return self._tracer.graph

    @property
    def report(self) -> CommReport:
        return self._report or self._build_report()  # inside the context: what ran so far

    def _build_report(self) -> CommReport:
        if self._tracer is None:
            raise RuntimeError("CommDebugMode: run something inside `with comm_mode:` first")
        if self.model is not None:  # kept in the graph, so a saved trace reports the same tree
            self._tracer.graph.graph["module_types"] = module_types(self.model)
        return CommReport(self._tracer.graph)

    # --- torch's API ----------------------------------------------------------------------------
    def generate_comm_debug_tracing_table(self, noise_level: int = 3) -> str:
        return tracing_table(self.report, noise_level)

    def log_comm_debug_tracing_table_to_file(self, file_name: str = "comm_mode_log.txt", noise_level: int = 3):
        write_table(self.report, noise_level, file_name)

    def generate_json_dump(self, file_name: str = "comm_mode_log.json", noise_level: int = 3):
        write_json(self.report, noise_level, file_name)

    def generate_html(self, file_name: str = "comm_mode_log.html", noise_level: int = 3):
        """The browser view: one self-contained page with the module tree and the tables."""
        write_html(self.report, noise_level, file_name)

    def get_total_counts(self) -> int:
        return len(self.report.collectives)

    def get_comm_counts(self) -> dict[str, int]:
        return self.report.comm_counts()

    def get_comm_module_counts(self) -> dict[str, dict[str, dict[str, int]]]:
        return self.report.module_counts()

    def get_parameter_info(self) -> dict[str, dict]:
        """fqn -> parameter name -> tensor, for the modules that ran (torch's meaning; shapes are this rank's)."""
        if self.model is None:
            return {}
        info = {m.name: dict(self.model.get_submodule(m.fqn).named_parameters(recurse=False))
                for m in self.report.modules.values()}
        return {name: params for name, params in info.items() if params}

    def get_collectives(self) -> list[dict]:
        """Every collective in traced order: module, phase, kind, reduce op, bytes, group, order, src, dst, tag."""
        return self.report.collectives

    def __repr__(self):
        return f"CommDebugMode(get_total_counts()={self.get_total_counts() if self._tracer else 0})"


def module_types(model) -> dict[str, str]:
    if model is None:
        return {}
    return {fqn: f"{type(m).__module__}.{type(m).__qualname__}" for fqn, m in model.named_modules()}
