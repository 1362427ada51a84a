"""What every section shares: the results file, one measured point, and a calibrated deployment."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import command_line, machine_info, machine_line, now_iso
from bench_served import summarize

from evaluation import calibrate, deployments, systems
from evaluation.workloads import Workload, make_workload
from tokenrouter.config import EngineConfig, load_config


class Results:
    """One section's results file, rewritten after every point (a run cut short keeps what it measured)."""

    def __init__(self, section: str, title: str, out_dir: Path, scale: float, notes: list[str]) -> None:
        info = machine_info()
        self.path = out_dir / f"{section}.json"
        self.out_dir = out_dir
        self.data: dict[str, Any] = {
            "section": section, "title": title, "command": command_line(), "date": now_iso(),
            "machine": info, "machine_line": machine_line(info), "scale": scale, "notes": list(notes),
            "workloads": {}, "calibration": {}, "rows": [],
        }

    def add(self, row: dict[str, Any]) -> None:
        self.data["rows"].append(row)
        self.save()

    def note(self, text: str) -> None:
        self.data["notes"].append(text[:500])
        self.save()

    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")

    def report(self) -> None:
        """The markdown tables, and the plots where matplotlib is installed."""
        from evaluation.report import write_report

        self.save()
        for p in write_report(self.data, self.out_dir):
            print(f"wrote {p}")


def _progress(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True, file=sys.stderr)


def vocab_and_special(cfg: EngineConfig) -> tuple[int, set[int]]:
    from tokenrouter.runner.arch import ArchConfig
    from tokenrouter.tokenizer import load_tokenizer

    vocab = ArchConfig.from_dir(cfg.entry_model.path).vocab_size
    return vocab, set(load_tokenizer(cfg.tokenizer_path).all_special_ids)


def measure(opened: systems.Opened, workload: Workload, c: int, cfg: EngineConfig, seed: int, label: str
            ) -> dict[str, Any]:
    """One point: a warm-up round of c short requests, then the workload's sessions at concurrency c."""
    vocab, special = vocab_and_special(cfg)
    sessions = workload.sessions(c, vocab, special, seed)
    systems.warm_up(opened, sessions[0].turns[0][:32], c)
    with _progress(sum(len(s.turns) for s in sessions), label) as bar:
        records = systems.run_point(opened, sessions, c, bar)
    row = summarize(c, records)
    tok = row.get("output_tok_s")
    print(f"{label}: {tok:,.1f} tok/s, {row['errors']} errors" if tok else f"{label}: {row['first_error']}",
          flush=True)
    return row


def calibration_set(cfg: EngineConfig, seed: int, workloads: list[str], scale: float, concurrency: list[int]
                    ) -> calibrate.CalibrationSet:
    """The first turns of every point `measure` will send (the same seeds), each generating its workload's
    cap up to calibrate.CALIBRATION_TOKENS: the threshold is calibrated on the measured prompts."""
    vocab, special = vocab_and_special(cfg)
    prompts, tokens = [], []
    for name in workloads:
        w = make_workload(name, scale)
        for c in concurrency:
            firsts = [s.turns[0] for s in w.sessions(c, vocab, special, seed)]
            prompts += firsts
            tokens += [min(w.max_tokens, calibrate.CALIBRATION_TOKENS)] * len(firsts)
    text = (f"{len(prompts)} prompts: the first turns of every measured point ({', '.join(workloads)}; "
            f"C={', '.join(map(str, concurrency))}), {min(tokens)}-{max(tokens)} tokens each")
    return calibrate.CalibrationSet(prompts, tokens, text)


@contextlib.contextmanager
def calibrated(algorithm: str, models: str, seed: int, work: Path, workloads: list[str], scale: float,
               concurrency: list[int]) -> Iterator[tuple[Path, EngineConfig, systems.Opened, dict[str, Any]]]:
    """`algorithm`'s deployment calibrated to its target share on an in-process engine of it, on the
    prompts of `workloads` x `concurrency` (calibration_set): yields the calibrated deployment YAML, its
    config, that engine (running, with the calibrated thresholds, so a caller can measure it without
    loading the models again), and the calibration record."""
    source = deployments.config_path(algorithm, models)
    base = load_config(source)
    print(f"== {algorithm}: calibrating {source.relative_to(deployments.REPO_ROOT)} "
          f"(target share {calibrate.TARGETS[algorithm][0]:.0%})", flush=True)
    t0 = time.perf_counter()
    cal_set = calibration_set(base, seed, workloads, scale, concurrency)
    probed = calibrate.probe(algorithm, base, cal_set)  # before the deployment holds the GPU
    with systems.in_process(base) as opened:
        cal = calibrate.calibrate(algorithm, base, cal_set, opened.engine(), probed)
        calibrate.apply(opened.engine(), cal["policy"])
        cal["record"]["seconds"] = round(time.perf_counter() - t0, 1)
        path = deployments.write_deployment(source, work / f"{algorithm}.yaml", cal["policy"])
        print(f"   {cal['record']['params']} -> share {cal['record'].get('measured_share', '-')}", flush=True)
        yield path, load_config(path), opened, cal["record"]
