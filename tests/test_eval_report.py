"""The evaluation report (perf/evaluation/report.py): tables computed and formatted right from partial results.

Each section gets small synthetic results with a missing system, a row whose requests failed and None
values; the tests check the figures a reader would look at (speed-ups, step ratios, the best sweep point)
and that every plot is a real PNG. The plot checks skip where matplotlib is not installed; the markdown
checks run everywhere, since the report must still be written then.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "perf"))

from evaluation import report  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HAS_MPL = report.load_matplotlib() is not None


def main_row(workload: str, algorithm: str, system: str, c: int, tok_s: float | None, **kw) -> dict:
    row = {
        "workload": workload,
        "algorithm": algorithm,
        "system": system,
        "concurrency": c,
        "requests": 2 * c,
        "errors": 0,
        "first_error": None,
        "output_tokens": 1000 * c,
        "duration_s": 10.0,
        "output_tok_s": tok_s,
        "per_user_tok_s": None if tok_s is None else tok_s / c,
        "ttft_ms_mean": 12.0,
        "ttft_ms_p50": 11.04,
        "ttft_ms_p99": 40.0,
        "e2e_ms_mean": 900.0,
        "e2e_ms_p50": 850.0,
        "e2e_ms_p99": 1200.0,
        "large_share": None if system in ("slm-only", "llm-only") else 0.0987,
        "handoffs_per_request": None if system in ("slm-only", "llm-only") else 3.5,
    }
    row.update(kw)
    return row


def header(section: str) -> dict:
    return {
        "section": section,
        "title": f"TokenRouter evaluation: {section}",
        "command": "python perf/evaluate.py --section " + section,
        "date": "2026-12-01T10:00:00+00:00",
        "machine_line": "1x H200, 16 cores",
        "scale": "0.25",
        "notes": ["dummy weights", "a | pipe in a note"],
    }


@pytest.fixture
def main_results() -> dict:
    rows = []
    for c in (1, 2, 4):
        rows.append(main_row("low-effort", "r2r", "triton", c, 1000.0 * c))
        rows.append(main_row("low-effort", "-", "slm-only", c, 3000.0 * c))
        rows.append(main_row("low-effort", "-", "llm-only", c, 400.0 * c))
    # std-serving at C=1 and C=2 only (C=4 missing); C=2 lost requests, so no ratio is taken from it.
    rows.append(main_row("low-effort", "r2r", "std-serving", 1, 800.0))
    rows.append(main_row("low-effort", "r2r", "std-serving", 2, 1900.0, errors=3, first_error="HTTP 500 | boom"))
    rows.append(main_row("low-effort", "r2r", "in-process", 1, None))
    # A second algorithm with triton only: its speed-up over llm-only comes from the shared reference rows.
    rows.append(main_row("low-effort", "mixture", "triton", 4, 4321.0))
    return {
        **header("main"),
        "workloads": {"low-effort": {"description": "~100-token prompts, cap 2,048", "output_cap": 2048}},
        "calibration": {
            "r2r": {
                "target_share": 0.1,
                "source": "R2R paper",
                "params": {"threshold": 0.123456},
                "measured_share": 0.098,
                "trials": [{"quantile": 0.9, "share": 0.098}],
                "signal_spread": {"between_prompts_std": 0.47, "within_prompt_std": 0.05},
            },
            "mixture": {"target_share": 0.2, "source": "weights", "params": {}, "measured_share": None},
        },
        "rows": rows,
    }


def table_row(md: str, *first_cells: str) -> str:
    """The markdown table line starting with these cells (fails the test when there is none)."""
    prefix = "| " + " | ".join(first_cells) + " |"
    lines = [line for line in md.splitlines() if line.startswith(prefix)]
    assert lines, f"no table row starting with {prefix!r} in:\n{md}"
    return lines[0]


def cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def assert_pngs(paths: list[Path], names: set[str]) -> None:
    pngs = {p.name for p in paths if p.suffix == ".png"}
    if not HAS_MPL:
        assert pngs == set()
        return
    assert pngs == names
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000, p


def test_calibration_not_converged_is_flagged() -> None:
    lines = report.calibration_lines({"r2r": {"target_share": 0.1, "measured_share": 0.135, "converged": False,
                                              "trials": [{"quantile": 0.9, "share": 0.135}]}})
    assert cells(table_row("\n".join(lines), "r2r"))[4] == "13.5 % (not converged)"


def test_formatting() -> None:
    assert report.fmt_tok_s(1234567.891) == "1,234,567.9"
    assert report.fmt_tok_s(None) == "n/a"
    assert report.fmt_tok_s(float("nan")) == "n/a"
    assert report.fmt_tok_s("error") == "n/a"
    assert report.fmt_ms(12.345) == "12.3"
    assert report.fmt_share(0.0987) == "9.9 %"
    assert report.fmt_ratio(2.5) == "2.50x"
    assert report.ratio(1.0, 0.0) is None


def test_main_section(tmp_path: Path, main_results: dict) -> None:
    paths = report.write_report(main_results, tmp_path)
    md_path = tmp_path / "main.md"
    assert paths[0] == md_path
    md = md_path.read_text()

    # Header: title, command, notes (the pipe escaped), workloads and calibration tables.
    assert md.startswith("# TokenRouter evaluation: main\n")
    assert "python perf/evaluate.py --section main" in md
    assert "- a | pipe in a note" in md
    assert "| low-effort | ~100-token prompts, cap 2,048 | 2,048 |" in md
    assert cells(table_row(md, "r2r", "10.0 %")) == ["r2r", "10.0 %", "R2R paper", "threshold=0.1235", "9.8 %",
                                                     "0.47 / 0.05"]
    assert cells(table_row(md, "mixture", "20.0 %"))[-2:] == ["-", "-"]  # fixed by its weights: no trials
    # Only mixture's routed row (9.9 % against 20 %) is flagged: r2r's 9.9 % is within 30 % of 10 %.
    assert ("Routed rows more than 30% (relative) from their target share (1): "
            "low-effort / mixture / triton C=4: 9.9 %.") in md

    # Speed-ups: C=1 triton 1000 / std-serving 800 = 1.25x, over llm-only 1000 / 400 = 2.50x;
    # C=2 std-serving had errors -> n/a; C=4 std-serving missing -> n/a, llm-only 4000 / 1600 = 2.50x.
    assert cells(table_row(md, "low-effort", "r2r", "1")) == ["low-effort", "r2r", "1", "1,000.0", "1.25x", "2.50x"]
    assert cells(table_row(md, "low-effort", "r2r", "2"))[4:] == ["n/a", "2.50x"]
    assert cells(table_row(md, "low-effort", "r2r", "4"))[4:] == ["n/a", "2.50x"]
    # mixture ran triton at C=4 only: 4321 / 1600 = 2.70x; at C=1 it has no triton row at all.
    assert cells(table_row(md, "low-effort", "mixture", "4")) == [
        "low-effort",
        "mixture",
        "4",
        "4,321.0",
        "n/a",
        "2.70x",
    ]
    assert cells(table_row(md, "low-effort", "mixture", "1"))[3:] == ["n/a", "n/a", "n/a"]

    # Per-(workload, algorithm) table: the references appear under both algorithms, ordered by C then system.
    r2r = md.split("### low-effort / r2r")[1].split("###")[0]
    order = [tuple(cells(line)[:2]) for line in r2r.splitlines() if re.match(r"\| \d", line)]
    assert order[:5] == [
        ("1", "triton"),
        ("1", "in-process"),
        ("1", "std-serving"),
        ("1", "slm-only"),
        ("1", "llm-only"),
    ]
    triton_c4 = cells(table_row(r2r, "4", "triton"))
    assert triton_c4 == ["4", "triton", "4,000.0", "1,000.0", "11.0 / 40.0", "850.0 / 1,200.0", "9.9 %", "3.50", "0"]
    assert cells(table_row(r2r, "1", "in-process"))[2:4] == ["n/a", "n/a"]
    assert cells(table_row(r2r, "1", "llm-only"))[6:8] == ["-", "n/a"]  # a single model has no routed share
    assert cells(table_row(r2r, "2", "std-serving"))[-1] == "3"
    assert "C=2 std-serving: 3 of 4 requests failed; first error: HTTP 500 | boom" in r2r
    mixture = md.split("### low-effort / mixture")[1]
    assert "| 4 | llm-only | 1,600.0 |" in mixture

    assert_pngs(paths, {f"main_low-effort_{s}.png" for s in ("throughput", "per_user", "ttft")})
    if HAS_MPL:
        assert "![main_low-effort_throughput](main_low-effort_throughput.png)" in md


def test_ablation_section(tmp_path: Path) -> None:
    steps = [
        (0, "eager", {"graphs": False, "overlap": False}, 1000.0, 0),
        (1, "+ CUDA graphs for extends", {"graphs": True, "overlap": False}, 1500.0, 0),
        (2, "+ overlap", {"graphs": True, "overlap": True}, 1800.0, 2),  # failed requests
        (3, "+ bigger batch", {"graphs": True, "overlap": True, "batch": 64}, 2700.0, 0),
        (5, "+ missing previous step", {"graphs": True}, None, 0),
    ]
    rows = [
        {
            "step": s,
            "label": label,
            "config": cfg,
            "concurrency": 16,
            "output_tok_s": tok_s,
            "per_user_tok_s": None if tok_s is None else tok_s / 16,
            "ttft_ms_p50": 20.0 + s,
            "large_share": 0.1 + s / 100,
            "errors": err,
            "requests": 32,
            "first_error": "timeout" if err else None,
        }
        for s, label, cfg, tok_s, err in steps
    ]
    paths = report.write_report({**header("ablation"), "rows": rows}, tmp_path)
    md = (tmp_path / "ablation.md").read_text()

    assert cells(table_row(md, "0", "eager"))[2:5] == ["1,000.0", "-", "1.00x"]
    assert cells(table_row(md, "1", "+ CUDA graphs for extends"))[2:8] == [
        "1,500.0", "1.50x", "1.50x", "93.8", "21.0", "11.0 %"]
    # Step 2 lost requests: its figure shows, but no ratio is taken from or against it.
    assert cells(table_row(md, "2", "+ overlap"))[2:5] == ["1,800.0", "n/a", "n/a"]
    assert cells(table_row(md, "3", "+ bigger batch"))[2:5] == ["2,700.0", "n/a", "2.70x"]
    assert cells(table_row(md, "5", "+ missing previous step"))[2:5] == ["n/a", "n/a", "n/a"]
    # The switch a step adds is in bold.
    assert table_row(md, "1", "+ CUDA graphs for extends").endswith("| **graphs=yes**, overlap=no |")
    assert table_row(md, "2", "+ overlap").endswith("| graphs=yes, **overlap=yes** |")
    assert table_row(md, "0", "eager").endswith("| graphs=no, overlap=no |")
    assert "**batch=64**" in table_row(md, "3", "+ bigger batch")
    assert "- C=16 step 2: 2 of 32 requests failed; first error: timeout" in md

    assert_pngs(paths, {"ablation_ablation.png"})


def test_sweep_section(tmp_path: Path) -> None:
    rows = [
        {
            "concurrency": 8,
            "thresholds": {"small": 1, "large": 2},
            "measured_tok_s": 900.0,
            "predicted_tok_s": 1000.0,
            "auto": False,
            "errors": 0,
        },
        {
            "concurrency": 8,
            "thresholds": {"small": 1, "large": 4},
            "measured_tok_s": 1200.0,
            "predicted_tok_s": 1000.0,
            "auto": True,
            "errors": 0,
        },
        {
            "concurrency": 8,
            "thresholds": {"small": 2, "large": 4},
            "measured_tok_s": 5000.0,
            "predicted_tok_s": None,
            "auto": False,
            "errors": 1,
        },  # highest, but it lost a request: not the best point
        {
            "concurrency": 8,
            "thresholds": {"small": 2, "large": 8},
            "measured_tok_s": 1500.0,
            "predicted_tok_s": 1400.0,
            "auto": False,
            "errors": 0,
        },
        {
            "concurrency": 1,
            "thresholds": {"small": 1, "large": 2},
            "measured_tok_s": None,
            "predicted_tok_s": 300.0,
            "auto": True,
            "errors": 0,
        },
    ]
    paths = report.write_report({**header("sweep"), "rows": rows}, tmp_path)
    md = (tmp_path / "sweep.md").read_text()
    c8 = md.split("### Concurrency 8")[1]
    c1 = md.split("### Concurrency 1")[1].split("### Concurrency 8")[0]

    assert "| thresholds (small/large) |" in md
    assert cells(table_row(c8, "1/2")) == ["1/2", "900.0", "1,000.0", "0.90x", "", "0"]
    assert cells(table_row(c8, "1/4")) == ["1/4", "1,200.0", "1,000.0", "1.20x", "**auto**", "0"]
    assert cells(table_row(c8, "2/4")) == ["2/4", "5,000.0", "n/a", "n/a", "", "1"]
    assert "Best measured: **2/8** at 1,500.0 tok/s; auto's pick 1/4 measured 1,200.0 tok/s (0.80x of the best)." in c8
    assert cells(table_row(c1, "1/2")) == ["1/2", "n/a", "300.0", "n/a", "**auto**", "0"]
    assert "Best measured: n/a (no clean measurement)." in c1

    assert_pngs(paths, {"sweep_sweep_c1.png", "sweep_sweep_c8.png"})


def test_without_matplotlib(tmp_path: Path, main_results: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    # matplotlib is an optional extra: without it the markdown must still be written, saying why no plots.
    monkeypatch.setattr(report, "load_matplotlib", lambda: None)
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        paths = report.write_report(main_results, tmp_path)
    assert paths == [tmp_path / "main.md"]
    md = paths[0].read_text()
    assert "_Plots not drawn: matplotlib is not installed" in md
    assert "| low-effort | r2r | 1 | 1,000.0 | 1.25x | 2.50x |" in md
    assert not list(tmp_path.glob("*.png"))


def test_empty_and_unknown_sections(tmp_path: Path) -> None:
    # A section whose every run failed before producing rows still gets its markdown, and no plot.
    for section in ("main", "ablation", "sweep"):
        paths = report.write_report({"section": section, "rows": []}, tmp_path)
        assert paths == [tmp_path / f"{section}.md"]
    with pytest.raises(ValueError, match="unknown section"):
        report.write_report({"section": "bogus"}, tmp_path)


def test_cli_regenerates_from_json(tmp_path: Path, main_results: dict) -> None:
    src = tmp_path / "results"
    src.mkdir()
    (src / "main.json").write_text(json.dumps(main_results))
    script = REPO / "perf" / "evaluation" / "report.py"
    out = subprocess.run(
        [sys.executable, str(script), str(src / "main.json")], capture_output=True, text=True, check=True
    )
    assert str(src / "main.md") in out.stdout.splitlines()
    assert "| low-effort | r2r | 1 | 1,000.0 | 1.25x | 2.50x |" in (src / "main.md").read_text()

    other = tmp_path / "elsewhere"
    subprocess.run(
        [sys.executable, str(script), str(src / "main.json"), "--out-dir", str(other)], check=True, capture_output=True
    )
    assert (other / "main.md").read_text() == (src / "main.md").read_text()


def test_speedups_fall_back_to_in_process_without_servers(tmp_path: Path) -> None:
    rows = [main_row("low-effort", "r2r", "in-process", 8, 900.0), main_row("low-effort", "-", "llm-only", 8, 300.0)]
    report.write_report({**header("main"), "rows": rows}, tmp_path)
    md = (tmp_path / "main.md").read_text()
    assert "## Speed-up of in-process (output tok/s ratio)" in md
    assert cells(table_row(md, "low-effort", "r2r", "8")) == ["low-effort", "r2r", "8", "900.0", "n/a", "3.00x"]
