"""Markdown tables and PNG plots for one section of the evaluation's results (the JSON perf/evaluate.py writes).

`write_report(results, out_dir)` writes `<out_dir>/<section>.md` and the section's plots and returns the
paths written; `python perf/evaluation/report.py RESULTS.json [...] [--out-dir DIR]` regenerates them from
saved JSON files, so a table or plot can be changed without re-running the GPU measurements.

A section can be partial (a system that failed to start, a point that was cut short): every missing or
non-numeric value prints as "n/a", and a row with failed requests keeps its measured figures in the tables
but is left out of ratios, plots and "best" picks, since a run that lost requests did less work than the
clean runs it would be compared with.

matplotlib is imported only when plotting: without it the markdown is still written, with a line saying
the plots were not drawn.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

NA = "n/a"
DPI = 120
SYSTEMS = ("triton", "in-process", "std-serving", "slm-only", "llm-only")
# Single-model baselines: they do not depend on the routing algorithm, so they appear in every algorithm's
# table and plot of their workload as references.
REFERENCE_SYSTEMS = ("slm-only", "llm-only")
SYSTEM_COLORS = {
    "triton": "tab:blue",
    "in-process": "tab:green",
    "std-serving": "tab:orange",
    "slm-only": "tab:gray",
    "llm-only": "tab:red",
}

Row = dict[str, Any]
# (row key, axis label, file-name suffix) of the main section's three figures per workload.
MAIN_METRICS = (
    ("output_tok_s", "output tok/s", "throughput"),
    ("per_user_tok_s", "per-user tok/s", "per_user"),
    ("ttft_ms_p50", "TTFT p50 (ms)", "ttft"),
)


# ----------------------------------------------------------------------------------------------------------
# Values and their formatting
# ----------------------------------------------------------------------------------------------------------


def num(value: Any) -> float | None:
    """A finite number, or None for anything else (None, NaN, a string left by a failed run, a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def errors_of(row: Row) -> int:
    """Failed requests of a row; a row that does not say is taken as clean (sweep rows may omit it)."""
    errors = num(row.get("errors"))
    return int(errors) if errors is not None else 0


def clean(row: Row | None, key: str) -> float | None:
    """`row[key]` for comparisons: None when the row is missing, the value is missing, or requests failed."""
    if row is None or errors_of(row) > 0:
        return None
    return num(row.get(key))


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def fmt_tok_s(value: Any) -> str:
    v = num(value)
    return NA if v is None else f"{v:,.1f}"


def fmt_ms(value: Any) -> str:
    v = num(value)
    return NA if v is None else f"{v:,.1f}"


def fmt_share(value: Any) -> str:
    v = num(value)
    return NA if v is None else f"{100 * v:.1f} %"


def fmt_ratio(value: Any) -> str:
    v = num(value)
    return NA if v is None else f"{v:.2f}x"


def fmt_float(value: Any, digits: int = 2) -> str:
    v = num(value)
    return NA if v is None else f"{v:,.{digits}f}"


def fmt_int(value: Any) -> str:
    v = num(value)
    return NA if v is None else f"{int(v):,}"


def fmt_any(value: Any) -> str:
    """Free-form values (workload fields, calibrated params, switches): short and unambiguous."""
    if value is None:
        return NA
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else NA
    if isinstance(value, dict):
        return ", ".join(f"{k}={fmt_any(v)}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt_any(v) for v in value) or "-"
    return str(value)


def cell(text: Any) -> str:
    """Text safe inside a markdown table cell: a '|' or a newline would break the row."""
    return str(text).replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines


def slug(text: Any) -> str:
    """A file-name-safe form of a workload or section name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(text)).strip("-") or "x"


def main_plot_path(out_dir: Path, section: Any, workload: Any, suffix: str) -> Path:
    return out_dir / f"{slug(section)}_{slug(workload)}_{suffix}.png"


def sweep_plot_path(out_dir: Path, section: Any, concurrency: Any) -> Path:
    return out_dir / f"{slug(section)}_sweep_c{slug(concurrency)}.png"


def unique(values: Iterable[Any]) -> list[Any]:
    """Distinct values in first-seen order (the order the suite ran them in)."""
    return list(dict.fromkeys(values))


# ----------------------------------------------------------------------------------------------------------
# The header every section shares
# ----------------------------------------------------------------------------------------------------------


def header_lines(results: dict[str, Any]) -> list[str]:
    lines = [f"# {results.get('title') or results.get('section', 'results')}", ""]
    if results.get("command"):
        lines += ["```", str(results["command"]), "```", ""]
    for label, key in (("Date", "date"), ("Machine", "machine_line"), ("Scale", "scale")):
        lines.append(f"- {label}: {fmt_any(results.get(key))}")
    lines.append("")
    notes = [n for n in results.get("notes") or [] if n]
    if notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    lines += workloads_lines(results.get("workloads") or {})
    lines += calibration_lines(results.get("calibration") or {})
    return lines


def workloads_lines(workloads: dict[str, dict[str, Any]]) -> list[str]:
    if not workloads:
        return []
    # Description first, then every other field any workload has, so the table is the union of them.
    fields = {name: w if isinstance(w, dict) else {"description": w} for name, w in workloads.items()}
    keys = unique(["description"] + [k for w in fields.values() for k in w])
    rows = [[name] + [fmt_any(w.get(k)) for k in keys] for name, w in fields.items()]
    return ["## Workloads", ""] + md_table(["workload"] + [k.replace("_", " ") for k in keys], rows) + [""]


def calibration_lines(calibration: dict[str, dict[str, Any]]) -> list[str]:
    if not calibration:
        return []
    header = ["algorithm", "target large share", "source", "calibrated params", "measured share",
              "signal std between / within prompts"]
    rows = [
        [
            algo,
            fmt_share(c.get("target_share")),
            fmt_any(c.get("source")),
            fmt_any(c.get("params")) if c.get("params") else "-",
            measured_text(c),
            spread_text(c.get("signal_spread")),
        ]
        for algo, c in calibration.items()
        if isinstance(c, dict)
    ]
    sets = unique(c.get("calibration_set") for c in calibration.values() if isinstance(c, dict))
    return (["## Calibration", ""] + [f"Calibrated on {s}." for s in sets if s] + [""] + md_table(header, rows)
            + ["", "Where the signal varies more between prompts than within one, the threshold routes some "
                   "requests heavily and others not at all (per request more than per token).", ""])


def measured_text(c: dict[str, Any]) -> str:
    """The calibration's best trial; '-' where the share is fixed (no trials), flagged when off tolerance."""
    if not c.get("trials"):
        return "-" if c.get("measured_share") is None else fmt_share(c["measured_share"])
    return fmt_share(c.get("measured_share")) + (" (not converged)" if c.get("converged") is False else "")


def spread_text(spread: Any) -> str:
    if not isinstance(spread, dict):
        return "-"
    # Three significant digits: R-Stitch's normalized entropy varies in the fourth decimal with dummy weights.
    return " / ".join(NA if num(spread.get(k)) is None else f"{num(spread.get(k)):.3g}"
                      for k in ("between_prompts_std", "within_prompt_std"))


def plot_lines(paths: Sequence[Path], missing_reason: str | None) -> list[str]:
    if missing_reason:
        return [f"_Plots not drawn: {missing_reason}._", ""]
    return [line for p in paths for line in (f"![{p.stem}]({p.name})", "")]


# ----------------------------------------------------------------------------------------------------------
# Section "main": systems x concurrency per workload and algorithm
# ----------------------------------------------------------------------------------------------------------


class MainIndex:
    """The main section's rows looked up by (workload, algorithm, system, concurrency).

    Reference systems are looked up without the algorithm (their rows carry "-"). When a key repeats,
    the later row wins: a point re-run after a failure is appended after the failed one.
    """

    def __init__(self, rows: Sequence[Row]):
        self.rows = [r for r in rows if isinstance(r, dict)]
        self._by_key: dict[tuple[Any, ...], Row] = {}
        for r in self.rows:
            self._by_key[self._key(r.get("workload"), r.get("algorithm"), r.get("system"), r.get("concurrency"))] = r

    @staticmethod
    def _key(workload: Any, algorithm: Any, system: Any, concurrency: Any) -> tuple[Any, ...]:
        return (workload, "-" if system in REFERENCE_SYSTEMS else algorithm, system, concurrency)

    def get(self, workload: Any, algorithm: Any, system: Any, concurrency: Any) -> Row | None:
        return self._by_key.get(self._key(workload, algorithm, system, concurrency))

    def workloads(self, declared: Iterable[str]) -> list[Any]:
        seen = {r.get("workload") for r in self.rows}
        return [w for w in declared if w in seen] + [
            w for w in unique(r.get("workload") for r in self.rows) if w not in declared
        ]

    def algorithms(self, workload: Any) -> list[Any]:
        algos = unique(
            r.get("algorithm")
            for r in self.rows
            if r.get("workload") == workload and r.get("system") not in REFERENCE_SYSTEMS
        )
        # A workload measured only on the baselines still gets one table, under "-".
        return algos or ["-"]

    def systems(self, workload: Any, algorithm: Any) -> list[Any]:
        present = unique(r.get("system") for r in self.rows_of(workload, algorithm))
        return [s for s in SYSTEMS if s in present] + [s for s in present if s not in SYSTEMS]

    def concurrencies(self, workload: Any) -> list[Any]:
        cs = unique(r.get("concurrency") for r in self.rows if r.get("workload") == workload)
        return sorted(cs, key=lambda c: (num(c) is None, num(c) or 0.0, str(c)))

    def rows_of(self, workload: Any, algorithm: Any) -> list[Row]:
        return [
            r
            for r in self.rows
            if r.get("workload") == workload
            and (r.get("algorithm") == algorithm or r.get("system") in REFERENCE_SYSTEMS)
        ]


def main_row_cells(row: Row) -> list[str]:
    return [
        fmt_int(row.get("concurrency")),
        fmt_any(row.get("system")),
        fmt_tok_s(row.get("output_tok_s")),
        fmt_tok_s(row.get("per_user_tok_s")),
        f"{fmt_ms(row.get('ttft_ms_p50'))} / {fmt_ms(row.get('ttft_ms_p99'))}",
        f"{fmt_ms(row.get('e2e_ms_p50'))} / {fmt_ms(row.get('e2e_ms_p99'))}",
        # A single model has no routing: its "large share" is its own (always 1), not a figure.
        "-" if row.get("system") in REFERENCE_SYSTEMS else fmt_share(row.get("large_share")),
        fmt_float(row.get("handoffs_per_request")),
        fmt_int(row.get("errors")),
    ]


SHARE_OFF = 0.3  # a routed row is flagged when its measured share is this far from the target (relative)


def share_notes(results: dict[str, Any]) -> list[str]:
    """Routed rows whose measured large share is more than SHARE_OFF from their algorithm's target: their
    throughput stands for that share, not for the target."""
    targets = {a: c.get("target_share") for a, c in (results.get("calibration") or {}).items() if isinstance(c, dict)}
    off = []
    for r in results.get("rows") or []:
        target, share = num(targets.get(r.get("algorithm"))), num(r.get("large_share"))
        if r.get("system") in REFERENCE_SYSTEMS or not target or share is None:
            continue
        if abs(share - target) > SHARE_OFF * target:
            where = f"{r.get('workload')} / {r.get('algorithm')} / {r.get('system')}"
            off.append(f"{where} C={fmt_any(r.get('concurrency'))}: {fmt_share(share)}")
    if not off:
        return []
    return [f"Routed rows more than {SHARE_OFF:.0%} (relative) from their target share ({len(off)}): "
            + "; ".join(off) + ".", ""]


def error_notes(rows: Iterable[Row]) -> list[str]:
    """One line per row with failed requests, so a reader sees why its figures are left out of ratios."""
    notes = []
    for r in rows:
        if errors_of(r) > 0:
            first = r.get("first_error")
            tail = f"; first error: {str(first).strip()[:300]}" if first else ""
            notes.append(f"- {row_name(r)}: {failed_text(r)}{tail}")
    return notes + [""] if notes else []


def row_name(row: Row) -> str:
    """How a row is named in notes: its concurrency plus whichever of system / step / thresholds it has."""
    parts = [f"C={fmt_any(row.get('concurrency'))}"]
    if row.get("system") is not None:
        parts.append(str(row["system"]))
    if row.get("step") is not None:
        parts.append(f"step {fmt_any(row['step'])}")
    if row.get("thresholds") is not None:
        parts.append(f"thresholds {thresholds_label(row['thresholds'])}")
    return " ".join(parts)


def failed_text(row: Row) -> str:
    requests = num(row.get("requests"))
    of = f" of {int(requests):,}" if requests is not None else ""
    return f"{errors_of(row)}{of} requests failed"


def main_table_lines(index: MainIndex, workload: Any, algorithm: Any) -> list[str]:
    rows = [
        row
        for c in index.concurrencies(workload)
        for s in index.systems(workload, algorithm)
        if (row := index.get(workload, algorithm, s, c)) is not None
    ]
    header = [
        "C",
        "system",
        "output tok/s",
        "per-user tok/s",
        "TTFT p50 / p99 ms",
        "E2E p50 / p99 ms",
        "large share",
        "handoffs/req",
        "errors",
    ]
    table = md_table(header, map(main_row_cells, rows))
    return [f"### {workload} / {algorithm}", ""] + table + [""] + error_notes(rows)


def speedup_rows(index: MainIndex, workloads: Sequence[Any], system: str = "triton") -> list[list[str]]:
    out = []
    for w in workloads:
        for a in index.algorithms(w):
            for c in index.concurrencies(w):
                triton = clean(index.get(w, a, system, c), "output_tok_s")
                std = clean(index.get(w, a, "std-serving", c), "output_tok_s")
                llm = clean(index.get(w, a, "llm-only", c), "output_tok_s")
                out.append(
                    [
                        fmt_any(w),
                        fmt_any(a),
                        fmt_int(c),
                        fmt_tok_s(triton),
                        fmt_ratio(ratio(triton, std)),
                        fmt_ratio(ratio(triton, llm)),
                    ]
                )
    return out


def main_lines(results: dict[str, Any], plots: Sequence[Path], missing_reason: str | None) -> list[str]:
    index = MainIndex(results.get("rows") or [])
    workloads = index.workloads(results.get("workloads") or {})
    # The served product when it was measured; the in-process engine when a run left the servers out.
    product = "triton" if any(r.get("system") == "triton" for r in index.rows) else "in-process"
    lines = [
        f"## Speed-up of {product} (output tok/s ratio)",
        "",
        "n/a where a system or point is missing, or where requests failed in either run (such points are also "
        "left out of the plots).",
        "",
    ]
    lines += md_table(
        ["workload", "algorithm", "C", f"{product} tok/s", "over std-serving", "over llm-only"],
        speedup_rows(index, workloads, product),
    ) + [""]
    lines += share_notes(results)
    for w in workloads:
        lines += [f"## {w}", ""]
        for a in index.algorithms(w):
            lines += main_table_lines(index, w, a)
        mine = {main_plot_path(Path(), results["section"], w, suffix).name for _, _, suffix in MAIN_METRICS}
        lines += plot_lines([p for p in plots if p.name in mine], missing_reason)
    return lines


# ----------------------------------------------------------------------------------------------------------
# Section "ablation": one switch added per step
# ----------------------------------------------------------------------------------------------------------


def ablation_groups(rows: Sequence[Row]) -> dict[Any, dict[int, Row]]:
    """Rows by concurrency, then by step (an ablation is usually run at one concurrency, but need not be)."""
    groups: dict[Any, dict[int, Row]] = {}
    for r in rows:
        step = num(r.get("step")) if isinstance(r, dict) else None
        if step is not None:
            groups.setdefault(r.get("concurrency"), {})[int(step)] = r
    return {c: dict(sorted(g.items())) for c, g in groups.items()}


def switches_text(config: Any, previous: Any) -> str:
    """The step's switches, the ones changed since the previous step in bold (they are what the step adds)."""
    if not isinstance(config, dict) or not config:
        return fmt_any(config) if config else "-"
    prev = previous if isinstance(previous, dict) else None
    parts = []
    for k, v in config.items():
        text = f"{k}={fmt_any(v)}"
        parts.append(f"**{text}**" if prev is not None and prev.get(k) != v else text)
    return ", ".join(parts)


def ablation_table(steps: dict[int, Row]) -> list[str]:
    base = clean(steps.get(0), "output_tok_s")
    rows = []
    for step, r in steps.items():
        prev = steps.get(step - 1)
        tok_s = clean(r, "output_tok_s")
        rows.append(
            [
                str(step),
                fmt_any(r.get("label")),
                fmt_tok_s(r.get("output_tok_s")),
                fmt_ratio(ratio(tok_s, clean(prev, "output_tok_s"))) if step > 0 else "-",
                fmt_ratio(ratio(tok_s, base)),
                fmt_tok_s(r.get("per_user_tok_s")),
                fmt_ms(r.get("ttft_ms_p50")),
                fmt_share(r.get("large_share")),
                fmt_int(r.get("errors")),
                switches_text(r.get("config"), prev.get("config") if prev else None),
            ]
        )
    header = [
        "step",
        "label",
        "output tok/s",
        "x previous",
        "x step 0",
        "per-user tok/s",
        "TTFT p50 ms",
        "large share",  # each step is a fresh run: its share differs a little, and throughput with it
        "errors",
        "switches",
    ]
    return md_table(header, rows)


def ablation_lines(results: dict[str, Any], plots: Sequence[Path], missing_reason: str | None) -> list[str]:
    lines = [
        "## Ablation",
        "",
        "x previous: against step - 1; n/a where that step is missing or either run had failed requests.",
        "",
    ]
    for c, steps in ablation_groups(results.get("rows") or []).items():
        lines += [f"### Concurrency {fmt_any(c)}", ""] + ablation_table(steps) + [""]
        lines += error_notes(steps.values())
    return lines + plot_lines(plots, missing_reason)


# ----------------------------------------------------------------------------------------------------------
# Section "sweep": thresholds vectors, measured against the model's prediction
# ----------------------------------------------------------------------------------------------------------


def thresholds_label(thresholds: Any) -> str:
    if isinstance(thresholds, dict):
        return "/".join(fmt_any(v) for v in thresholds.values()) or "-"
    return fmt_any(thresholds)


def thresholds_names(rows: Sequence[Row]) -> str:
    for r in rows:
        if isinstance(r.get("thresholds"), dict) and r["thresholds"]:
            return "/".join(map(str, r["thresholds"]))
    return "thresholds"


def sweep_groups(rows: Sequence[Row]) -> dict[Any, list[Row]]:
    """Rows per concurrency (ascending), each sorted by threshold vector so every plot reads left to right."""
    groups: dict[Any, list[Row]] = {}
    for r in rows:
        if isinstance(r, dict):
            groups.setdefault(r.get("concurrency"), []).append(r)

    def vector(r: Row) -> tuple[float, ...]:
        t = r.get("thresholds")
        return tuple(num(v) or 0.0 for v in t.values()) if isinstance(t, dict) else ()

    ordered = sorted(groups, key=lambda c: (num(c) is None, num(c) or 0.0, str(c)))
    return {c: sorted(groups[c], key=vector) for c in ordered}


def best_line(rows: Sequence[Row]) -> str:
    candidates = [(clean(r, "measured_tok_s"), r) for r in rows]
    candidates = [(v, r) for v, r in candidates if v is not None]
    if not candidates:
        return "Best measured: n/a (no clean measurement)."
    best_v, best = max(candidates, key=lambda vr: vr[0])
    text = f"Best measured: **{thresholds_label(best.get('thresholds'))}** at {fmt_tok_s(best_v)} tok/s"
    auto = next((r for r in rows if r.get("auto") is True), None)
    if auto is None:
        return text + "; no point is marked auto."
    auto_v = clean(auto, "measured_tok_s")
    return (
        text + f"; auto's pick {thresholds_label(auto.get('thresholds'))} measured {fmt_tok_s(auto_v)} tok/s"
        f" ({fmt_ratio(ratio(auto_v, best_v))} of the best)."
    )


def sweep_table(rows: Sequence[Row]) -> list[str]:
    out = [
        [
            thresholds_label(r.get("thresholds")),
            fmt_tok_s(r.get("measured_tok_s")),
            fmt_tok_s(r.get("predicted_tok_s")),
            fmt_ratio(ratio(clean(r, "measured_tok_s"), clean(r, "predicted_tok_s"))),
            "**auto**" if r.get("auto") is True else "",
            fmt_int(r.get("errors", 0)),
        ]
        for r in rows
    ]
    header = [
        f"thresholds ({thresholds_names(rows)})",
        "measured tok/s",
        "predicted tok/s",
        "measured/predicted",
        "auto",
        "errors",
    ]
    return md_table(header, out)


def sweep_lines(results: dict[str, Any], plots: Sequence[Path], missing_reason: str | None) -> list[str]:
    lines = ["## Threshold sweep", ""]
    for c, rows in sweep_groups(results.get("rows") or []).items():
        lines += [f"### Concurrency {fmt_any(c)}", ""] + sweep_table(rows) + ["", best_line(rows), ""]
        lines += error_notes(rows)
        mine = sweep_plot_path(Path(), results["section"], c).name
        lines += plot_lines([p for p in plots if p.name == mine], missing_reason)
    return lines


# ----------------------------------------------------------------------------------------------------------
# Plots (matplotlib imported here only)
# ----------------------------------------------------------------------------------------------------------


def load_matplotlib() -> Any:
    """A function making matplotlib Figures drawn by the Agg canvas, or None when matplotlib is not installed.

    Each figure gets its own Agg canvas instead of going through pyplot and `matplotlib.use("Agg")`: no
    global backend or figure state is changed, so a caller that uses another backend is left alone and no
    figure is kept alive between calls.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None

    def new_figure(**kwargs: Any) -> Any:
        fig = Figure(**kwargs)
        FigureCanvasAgg(fig)
        return fig

    return new_figure


def series(rows_by_c: dict[Any, Row | None], key: str) -> list[float]:
    """Values in concurrency order; NaN where missing, so the line shows a gap instead of a false point."""
    return [v if (v := clean(r, key)) is not None else math.nan for r in rows_by_c.values()]


def draw_main_metric(new_figure: Any, index: MainIndex, workload: Any, key: str, ylabel: str, path: Path) -> bool:
    algos = index.algorithms(workload)
    cs = [c for c in index.concurrencies(workload) if num(c) is not None and num(c) > 0]
    if not cs:
        return False
    fig = new_figure(figsize=(4.6 * len(algos) + 1.6, 4.2), layout="constrained")
    axes = fig.subplots(1, len(algos), sharey=True, squeeze=False)[0]
    handles: dict[str, Any] = {}
    drawn = False
    for ax, algo in zip(axes, algos):
        for system in index.systems(workload, algo):
            ys = series({c: index.get(workload, algo, system, c) for c in cs}, key)
            if all(math.isnan(y) for y in ys):
                continue
            drawn = True
            dashed = system in REFERENCE_SYSTEMS
            (line,) = ax.plot(
                cs,
                ys,
                marker="o",
                linestyle="--" if dashed else "-",
                linewidth=1.6,
                color=SYSTEM_COLORS.get(system),
                label=str(system),
            )
            handles.setdefault(str(system), line)
        format_concurrency_axis(ax, cs)
        ax.set_title(str(algo))
        ax.set_xlabel("concurrency (clients)")
        ax.grid(True, alpha=0.3)
    if not drawn:
        return False
    axes[0].set_ylabel(ylabel)
    axes[0].set_ylim(bottom=0)
    thousands_axis(axes[0])
    fig.suptitle(f"{workload}: {ylabel} vs concurrency")
    fig.legend(list(handles.values()), list(handles), loc="outside right center", title="system")
    fig.savefig(path, dpi=DPI)
    return True


def format_concurrency_axis(ax: Any, cs: Sequence[Any]) -> None:
    """log2 x axis labelled at the measured concurrencies (1, 2, 4, 8, 16), without minor ticks."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks([num(c) for c in cs])
    ax.set_xticklabels([fmt_any(c) for c in cs])
    ax.xaxis.set_minor_locator(NullLocator())


def thousands_axis(ax: Any) -> None:
    """y tick labels as 12,000 rather than 12000 or 1.2e4, matching the tables (small values keep decimals:
    a TTFT axis may tick at 0.5 ms)."""
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:,.0f}" if abs(y) >= 100 else f"{y:g}"))


def draw_main(new_figure: Any, results: dict[str, Any], out_dir: Path) -> list[Path]:
    index = MainIndex(results.get("rows") or [])
    written = []
    for w in index.workloads(results.get("workloads") or {}):
        for key, ylabel, suffix in MAIN_METRICS:
            path = main_plot_path(out_dir, results["section"], w, suffix)
            if draw_main_metric(new_figure, index, w, key, ylabel, path):
                written.append(path)
    return written


def bar_chart(
    new_figure: Any,
    path: Path,
    categories: Sequence[str],
    bars: dict[str, list[float | None]],
    title: str,
    ylabel: str,
    xlabel: str,
    highlight: int | None = None,
) -> bool:
    """Grouped bars, one group per category; a missing value gets an "n/a" mark instead of a zero bar."""
    if not categories or all(v is None for vs in bars.values() for v in vs):
        return False
    fig = new_figure(figsize=(max(5.0, 0.9 * len(categories) * max(1, len(bars)) + 2.0), 4.8), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(1, len(bars))
    for i, (name, values) in enumerate(bars.items()):
        xs = [k + (i - (len(bars) - 1) / 2) * width for k in range(len(categories))]
        heights = [v if v is not None else 0.0 for v in values]
        edges = ["black" if k == highlight else "none" for k in range(len(categories))]
        ax.bar(xs, heights, width, label=name, edgecolor=edges, linewidth=2.0)
        for x, v in zip(xs, values):
            if v is None:
                ax.annotate(NA, (x, 0), ha="center", va="bottom", fontsize=8, rotation=90)
    ax.set_xticks(range(len(categories)))
    ax.set_xticklabels(
        categories, rotation=30 if len(categories) > 3 else 0, ha="right" if len(categories) > 3 else "center"
    )
    if highlight is not None:
        ax.get_xticklabels()[highlight].set_fontweight("bold")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    thousands_axis(ax)
    if len(bars) > 1:
        ax.legend()
    fig.savefig(path, dpi=DPI)
    return True


def draw_ablation(new_figure: Any, results: dict[str, Any], out_dir: Path) -> list[Path]:
    groups = ablation_groups(results.get("rows") or [])
    steps = sorted({s for g in groups.values() for s in g})
    labels = []
    for s in steps:
        label = next((g[s].get("label") for g in groups.values() if s in g and g[s].get("label")), None)
        labels.append(f"{s}: {label}" if label else str(s))
    bars = {f"C={fmt_any(c)}": [clean(g.get(s), "output_tok_s") for s in steps] for c, g in groups.items()}
    path = out_dir / f"{slug(results['section'])}_ablation.png"
    title = "Ablation: output tok/s per step"
    if len(groups) == 1:
        title += f" at C={fmt_any(next(iter(groups)))}"
    ok = bar_chart(new_figure, path, labels, bars, title, "output tok/s", "step")
    return [path] if ok else []


def draw_sweep(new_figure: Any, results: dict[str, Any], out_dir: Path) -> list[Path]:
    written = []
    for c, rows in sweep_groups(results.get("rows") or []).items():
        labels = [thresholds_label(r.get("thresholds")) for r in rows]
        bars = {
            "measured": [clean(r, "measured_tok_s") for r in rows],
            "predicted": [num(r.get("predicted_tok_s")) for r in rows],
        }
        auto = next((i for i, r in enumerate(rows) if r.get("auto") is True), None)
        title = f"Threshold sweep at C={fmt_any(c)}"
        if auto is not None:
            title += f" (auto: {labels[auto]}, outlined)"
        path = sweep_plot_path(out_dir, results["section"], c)
        if bar_chart(
            new_figure,
            path,
            labels,
            bars,
            title,
            "output tok/s",
            f"thresholds ({thresholds_names(rows)})",
            highlight=auto,
        ):
            written.append(path)
    return written


# ----------------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------------

SECTIONS = {
    "main": (draw_main, main_lines),
    "ablation": (draw_ablation, ablation_lines),
    "sweep": (draw_sweep, sweep_lines),
}


def write_report(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write `<out_dir>/<section>.md` and the section's PNG plots; return the paths written (markdown first).

    Raises ValueError for a section other than main / ablation / sweep. Without matplotlib only the markdown
    is written (with a line saying so) and a warning is issued.
    """
    section = results.get("section") if isinstance(results, dict) else None
    if section not in SECTIONS:
        raise ValueError(f"unknown section {section!r}; expected one of {sorted(SECTIONS)}")
    draw, body = SECTIONS[section]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    new_figure = load_matplotlib()
    missing_reason = None
    plots: list[Path] = []
    if new_figure is None:
        missing_reason = "matplotlib is not installed (pip install -e '.[perf]')"
        warnings.warn(f"report: {missing_reason}; writing the markdown only", stacklevel=2)
    else:
        plots = draw(new_figure, results, out_dir)
    md = out_dir / f"{slug(section)}.md"
    md.write_text("\n".join(header_lines(results) + body(results, plots, missing_reason)).rstrip() + "\n")
    return [md] + plots


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="section JSON files written by perf/evaluate.py")
    parser.add_argument("--out-dir", type=Path, default=None, help="where to write (default: each JSON's folder)")
    args = parser.parse_args(argv)
    status = 0
    for path in args.results:
        # One unreadable file should not stop the others from being regenerated.
        try:
            written = write_report(json.loads(path.read_text()), args.out_dir or path.parent)
        except (OSError, ValueError, AttributeError) as e:
            print(f"{path}: {e}", file=sys.stderr)
            status = 1
            continue
        print("\n".join(map(str, written)))
    return status


if __name__ == "__main__":
    sys.exit(main())
