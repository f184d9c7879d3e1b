"""Renders a CommReport (syntorch/comm_debug.py) as torch's CommDebugMode does: a text table, a JSON dump with
torch's fields (plus syntorch's), and one self-contained HTML page with a collapsible module tree."""
import contextlib
import html
import json
import re
from pathlib import Path

from syntorch.trace.comm_view import (GLOBAL, RUNNING, SECTIONS, CommReport, ModuleInfo, OpRecord,
                                        check_noise_level, fold_steps)
from syntorch.trace.folds import step_span
from syntorch.outdir import atomic_output_file

SECTION_TITLES = {"forward": "FORWARD PASS", "backward": "BACKWARD PASS", "optimizer": "OPTIMIZER STEP"}
YELLOW, RED, RESET = "\033[1;33m", "\033[1;31m", "\033[0m"  # torch's colours
ANSI_ESCAPE = re.compile(r"\x1B\[[0-?]*[ -/]*[@-~]")


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def collective_details(c: dict) -> str:
    """'bytes: 160, group: [0, 1], reduce_op: sum, order: 0' plus src/dst/tag where they mean something."""
    parts = [f"bytes: {c['bytes']}", f"group: {c['group']}"]
    parts += [f"{key}: {c[key]}" for key in ("reduce_op", "src", "dst") if c.get(key) is not None]
    if c["collective"] in ("send", "recv"):
        parts.append(f"tag: {c['tag']}")
    return ", ".join(parts + [f"order: {c['order']}"])


def folded_collective(c: dict, copies: list[dict]) -> dict:
    """A collective standing for itself in later decode steps too: its order and tag in the first and the
    last (when they differ)."""
    if not copies:
        return c
    return {**c, **{k: f"{c[k]}…{copies[-1][k]}" for k in RUNNING if c.get(k) != copies[-1].get(k)}}


def shapes_text(first: list, last: list) -> str:
    """Input shapes, with the entries that grow over folded decode steps as first–last: [1, 12, 11–29, 64]."""
    return "[" + ", ".join("[" + ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in zip(s, t)) + "]"
                           for s, t in zip(first, last)) + "]"


def phase_rows(phase_totals: dict, runs: dict) -> list[tuple[str, str, int, int, int]]:
    """(phase, collective kind, count, bytes, steps) per phase, a run of identical decode steps in one row
    whose count and bytes are those of all its steps."""
    later = {p for run in runs.values() for p in run[1:]}
    rows = []
    for phase, kinds in phase_totals.items():
        if phase in later:
            continue
        run = runs.get(phase, [phase])
        for kind in kinds:
            count, nbytes = (sum(phase_totals[p][kind][i] for p in run) for i in (0, 1))
            rows.append((step_span(run), kind, count, nbytes, len(run)))
    return rows


def per_step(total: int, steps: int, text=str) -> str:
    """'38' or, over folded steps, '38 (2 a step)'."""
    return text(total) if steps == 1 else f"{text(total)} ({text(total // steps)} a step)"


def shard_text(param: dict) -> str:
    """What torch shows as a parameter's placement; syntorch knows this rank's shard shape."""
    return f"local shape {param['shape']} {param['dtype']}"


# --- text -----------------------------------------------------------------------------------------
def tracing_table(report: CommReport, noise_level: int, color: bool = True) -> str:
    noise_level = check_noise_level(noise_level)
    lines = []
    for module in report.walk():
        lines += _module_lines(report, module, noise_level)
    lines += _phase_total_lines(report)
    text = "\n".join(lines) + "\n"
    return text if color else ANSI_ESCAPE.sub("", text)


def _module_lines(report: CommReport, module: ModuleInfo, noise_level: int) -> list[str]:
    indent = "  " * (2 * module.depth)
    lines = [f"{indent}{module.name}"]
    if noise_level >= 1 and module.module_type:
        lines.append(f"{indent}*module type: {module.module_type}")
    if noise_level >= 1 and module.parameters:
        lines.append(f"{indent}*Parameter List")
        lines += [f"{indent} *{name}: {shard_text(p)}" for name, p in module.parameters.items()]
    for section in SECTIONS:
        lines += _section_lines(report, module, section, noise_level)
    return lines


def _section_lines(report: CommReport, module: ModuleInfo, section: str, noise_level: int) -> list[str]:
    records = [r for r in module.records if r.section == section and r.visible_at(noise_level)]
    if not module.totals[section] and not records:
        return []
    collective_indent = "  " * (2 * module.depth + 2)
    lines = [f"{'  ' * (2 * module.depth + 1)}{SECTION_TITLES[section]}"]
    lines += [f"{YELLOW}{collective_indent}*{kind}: {count} ({format_bytes(nbytes)}){RESET}"
              for kind, (count, nbytes) in module.totals[section].items()]
    for record, copies in report.fold_steps(records):
        steps = f" ({step_span([record.phase] + [c.phase for c in copies])})" if copies else ""
        lines.append(f"{YELLOW}{collective_indent}**{record.name}{steps}{RESET}")
        lines += [f"{RED}{collective_indent}  {detail}{RESET}" for detail in _record_details(record, copies)]
    return lines


def _record_details(record: OpRecord, copies: list[OpRecord]) -> list[str]:
    if record.kind == "collective":
        return [collective_details(folded_collective(record.collective, [c.collective for c in copies]))]
    last = copies[-1] if copies else record
    details = [f"shape: {shapes_text(record.input_shapes, last.input_shapes)}"] if record.input_shapes else []
    return details + ([f"params: {record.params}"] if record.params else [])


def _phase_total_lines(report: CommReport) -> list[str]:
    lines, last = ["TOTALS PER PHASE"], None
    for phase, kind, count, nbytes, steps in phase_rows(report.phase_totals, report.step_runs):
        if phase != last:
            lines.append(f"  {phase}")
            last = phase
        each = f", {count // steps} ({format_bytes(nbytes // steps)}) a step" if steps > 1 else ""
        lines.append(f"    *{kind}: {count} ({format_bytes(nbytes)}){each}")
    count = len(report.collectives)
    nbytes = sum(c["bytes"] or 0 for c in report.collectives)
    lines.append(f"  all phases: {count} collective{'s' * (count != 1)}, {format_bytes(nbytes)}")
    return lines


def write_table(report: CommReport, noise_level: int, path) -> None:
    """torch's log_comm_debug_tracing_table_to_file: the table without colours."""
    write_reports(report, noise_level, {"file": ("log", path)})


# --- JSON -----------------------------------------------------------------------------------------
def json_tree(report: CommReport, noise_level: int) -> dict:
    """torch's generate_json_dump tree (fqn, module_type, parameters, children, collectives_forward/backward,
    operations_forward/backward/checkpointing) with syntorch's fields added: bytes per section, each op's phase
    and node id, each collective's details, and at the root the run, the per-phase totals, every collective and
    the runs of identical decode steps that the table and the HTML list once (step_runs: {first: steps})."""
    noise_level = check_noise_level(noise_level)
    root = _module_json(report, report.modules[""], noise_level)
    root.update(noise_level=noise_level, phase_totals={
        phase: {kind: {"count": c, "bytes": b} for kind, (c, b) in kinds.items()}
        for phase, kinds in report.phase_totals.items()}, collectives=report.collectives,
        step_runs=report.step_runs)
    root.update({key: report.graph_attrs.get(key) for key in ("model", "rank", "world_size", "tp", "pp", "dp")})
    return root


def _module_json(report: CommReport, module: ModuleInfo, noise_level: int) -> dict:
    out = {"fqn": module.name, "module_type": module.module_type if noise_level >= 1 else "",
           "parameters": [[name, shard_text(p)] for name, p in module.parameters.items()] if noise_level >= 1 else [],
           "children": [_module_json(report, report.modules[c], noise_level) for c in module.children]}
    for section in SECTIONS:
        totals = module.totals[section]
        out[f"collectives_{section}"] = [[kind, count] for kind, (count, _) in totals.items()]
        out[f"bytes_{section}"] = {kind: nbytes for kind, (_, nbytes) in totals.items()}
        out[f"operations_{section}"] = [_op_json(r) for r in module.records
                                        if r.section == section and r.visible_at(noise_level)]
    out["operations_checkpointing"] = []  # the tracer does not tell recomputation apart
    return out


def _op_json(record: OpRecord) -> dict:
    return {"name": record.name, "input_shape": [str(s) for s in record.input_shapes], "params": record.params,
            "is_bw": record.section == "backward", "phase": record.phase, "node": record.node, **record.collective}


def write_json(report: CommReport, noise_level: int, path) -> None:
    write_reports(report, noise_level, {"file": ("json", path)})


# --- HTML -----------------------------------------------------------------------------------------
# One file, no network: the style and the ~20 lines of script that fold the tree are inlined.
PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<title>{title}</title>
<style>
body {{ font-family: arial, sans-serif; margin: 20px; }}
ul.tree, ul.tree ul {{ list-style-type: none; margin: 0; padding-left: 20px; }}
.caret {{ cursor: pointer; user-select: none; font-weight: bold; }}
.caret::before {{ content: "\\25B6"; display: inline-block; margin-right: 6px; }}
.caret-down::before {{ transform: rotate(90deg); }}
.nested {{ display: none; }}
.nested.active {{ display: block; }}
.badge {{ color: #a0522d; margin-left: 8px; font-size: 90%; }}
.pass {{ margin: 6px 0 6px 20px; }}
.pass-title {{ font-weight: bold; color: #555; }}
table {{ border-collapse: collapse; margin: 4px 0 10px 0; font-size: 90%; }}
td, th {{ border: 1px solid #ddd; text-align: left; padding: 4px 8px; }}
tr:nth-child(even) {{ background-color: #eee; }}
button {{ margin-right: 8px; }}
</style>
</head>
<body>
<h1>{title}</h1>
<p id="run">{run}</p>
<h2>Totals per phase</h2>
{phase_table}
<h2>Module tree</h2>
<p><button id="expand-all">Expand all</button><button id="collapse-all">Collapse all</button></p>
<ul class="tree" id="tree">
{tree}
</ul>
<h2>Collectives</h2>
{collective_table}
<script>
function setOpen(caret, open) {{
  caret.classList.toggle("caret-down", open);
  caret.parentElement.querySelector(":scope > .nested").classList.toggle("active", open);
}}
document.querySelectorAll("#tree .caret").forEach(function (caret) {{
  caret.addEventListener("click", function () {{ setOpen(caret, !caret.classList.contains("caret-down")); }});
}});
document.getElementById("expand-all").addEventListener("click", function () {{
  document.querySelectorAll("#tree .caret").forEach(function (c) {{ setOpen(c, true); }});
}});
document.getElementById("collapse-all").addEventListener("click", function () {{
  document.querySelectorAll("#tree .caret").forEach(function (c) {{ setOpen(c, false); }});
}});
</script>
</body>
</html>
"""
COLLECTIVE_COLUMNS = ("node", "module", "phase", "steps", "collective", "reduce_op", "bytes", "group", "order", "src",
                      "dst", "tag")


def render_html(tree: dict) -> str:
    """The page for a json_tree(): run summary, per-phase totals, the module tree (Global open, the rest
    folded) and every collective; identical decode steps in one row (tree["step_runs"]) with their count."""
    title = f"CommDebugMode: {tree.get('model') or 'run'}, rank {tree.get('rank')}"
    run = (f"rank {tree.get('rank')} of {tree.get('world_size')} (tp {tree.get('tp')}, pp {tree.get('pp')}, "
           f"dp {tree.get('dp')}), noise level {tree['noise_level']}, {len(tree['collectives'])} collectives")
    runs = tree.get("step_runs") or {}
    totals = {phase: {kind: (t["count"], t["bytes"]) for kind, t in kinds.items()}
              for phase, kinds in tree["phase_totals"].items()}
    phase_table = [[phase, kind, per_step(count, steps), per_step(nbytes, steps, format_bytes)]
                   for phase, kind, count, nbytes, steps in phase_rows(totals, runs)]
    collective_rows = []
    for c, copies in fold_steps(tree["collectives"], runs, phase=lambda c: c["phase"]):
        c = {**folded_collective(c, copies), "phase": _steps(c, copies), "steps": 1 + len(copies)}
        collective_rows.append([c["node"], c["module"] or GLOBAL, *(c[k] for k in COLLECTIVE_COLUMNS[2:])])
    return PAGE.format(title=_e(title), run=_e(run), tree=_tree_item(tree, runs, is_root=True),
                       phase_table=_table(["phase", "collective", "count", "bytes"], phase_table),
                       collective_table=_table(COLLECTIVE_COLUMNS, collective_rows))


def _steps(item: dict, copies: list[dict]) -> str:
    return step_span([item["phase"]] + [c["phase"] for c in copies])


def _tree_item(node: dict, runs: dict, is_root: bool = False) -> str:
    badge = "; ".join(f"{s}: " + ", ".join(f"{kind} \u00d7{count}" for kind, count in node[f"collectives_{s}"])
                      for s in SECTIONS if node[f"collectives_{s}"])
    body = [_module_info(node)] + [_pass_html(node, s, runs) for s in SECTIONS]
    children = "".join(_tree_item(child, runs) for child in node["children"])
    body.append(f"<ul>{children}</ul>" if children else "")
    opened = " caret-down" if is_root else ""
    return (f'<li data-fqn="{_e(node["fqn"])}"><span class="caret{opened}">{_e(node["fqn"])}</span>'
            f'<span class="badge">{_e(badge)}</span>'
            f'<div class="nested{" active" if is_root else ""}">{"".join(body)}</div></li>')


def _module_info(node: dict) -> str:
    info = f"<div class=\"pass\">module type: {_e(node['module_type'])}</div>" if node["module_type"] else ""
    if node["parameters"]:
        info += '<div class="pass">' + _table(["parameter", "shard"], node["parameters"]) + "</div>"
    return info


def _pass_html(node: dict, section: str, runs: dict) -> str:
    counts, ops = node[f"collectives_{section}"], node[f"operations_{section}"]
    if not counts and not ops:
        return ""
    nbytes = node[f"bytes_{section}"]
    parts = [f'<div class="pass"><span class="pass-title">{SECTION_TITLES[section]}</span>',
             _table(["collective", "count", "bytes"], [[k, c, format_bytes(nbytes[k])] for k, c in counts])]
    if ops:
        rows = [[op["name"], _steps(op, copies), _op_inputs(op, copies), ", ".join(op["params"])]
                for op, copies in fold_steps(ops, runs, phase=lambda op: op["phase"])]
        parts.append(_table(["op", "phase", "inputs / details", "params"], rows))
    return "".join(parts) + "</div>"


def _op_inputs(op: dict, copies: list[dict]) -> str:
    if "collective" in op:
        return collective_details(folded_collective(op, copies))
    if not copies:
        return ", ".join(op["input_shape"])
    return shapes_text(*([json.loads(s) for s in o["input_shape"]] for o in (op, copies[-1])))[1:-1]


def _table(header, rows) -> str:
    if not rows:
        return ""
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _e(value) -> str:
    return html.escape("" if value is None else str(value))


def write_html(report: CommReport, noise_level: int, path) -> None:
    write_reports(report, noise_level, {"file": ("html", path)})


RENDERERS = {"log": lambda report, level: tracing_table(report, level, color=False),
             "json": lambda report, level: json.dumps(json_tree(report, level), indent=2),
             "html": lambda report, level: render_html(json_tree(report, level))}


def write_reports(report: CommReport, noise_level: int, outputs: dict) -> None:
    """Writes `outputs` ({flag: (kind, path)}, kind log, json or html; the flag names the file in messages)
    all or none: every file's temporary is made before any is written, and all are renamed at the end."""
    with contextlib.ExitStack() as stack:
        temporaries = [(stack.enter_context(atomic_output_file(path, flag)), kind)
                       for flag, (kind, path) in outputs.items()]
        for tmp, kind in temporaries:
            tmp.write_text(RENDERERS[kind](report, noise_level), encoding="utf-8")


def write_comm_outputs(graph, out_dir, noise_level: int = 1, name: str = "comm_debug") -> CommReport:
    """What `syntorch infer --comm_debug` writes beside its other outputs: <name>_log.txt (the table),
    <name>.json (the dump) and <name>.html (the browser view). Returns the report, e.g. to print its table."""
    report = CommReport(graph)
    out_dir = Path(out_dir)
    write_reports(report, noise_level, {"log": ("log", out_dir / f"{name}_log.txt"),
                                        "json": ("json", out_dir / f"{name}.json"),
                                        "html": ("html", out_dir / f"{name}.html")})
    return report
