"""Every shipped deployment config parses; the tiny CPU ones also serve a request end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenrouter import Engine, SamplingParams, load_config
from tokenrouter.cli import main

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"
ALL = sorted(CONFIG_DIR.rglob("*.yaml"))
TINY = [p for p in ALL if "tiny" in p.name or p.parent.name == "tiny"]


def test_configs_exist() -> None:
    policies = {p.parent.name for p in ALL}
    expected = {"always", "random", "query", "r2r", "citer", "rstitch", "collm", "mixture", "glimprouter"}
    assert expected <= policies


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_parses(path: Path, tiny_dir: Path, bench_tokenizer_dir: Path) -> None:
    cfg = load_config(path)
    assert cfg.entry in cfg.models


@pytest.mark.parametrize("path", TINY, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_tiny_config_serves(path: Path, tiny_dir: Path) -> None:
    with Engine.from_config(path) as engine:
        out = engine.generate(["def main():"], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))[0]
        assert len(out.token_ids) == 6 and out.finish_reason == "length"
        assert sum(out.stats["tokens_per_model"].values()) == 6
        engine.check_integrity()


def test_cli_generate(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "generate",
            "--config",
            str(CONFIG_DIR / "r2r" / "tiny-small_tiny-large.yaml"),
            "--prompt",
            "import os",
            "--max-tokens",
            "5",
            "--ignore-eos",
        ]
    )
    assert rc == 0
    assert "5 tokens, finish_reason=length" in capsys.readouterr().out


def test_cli_generate_reports_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: {small: {path: /nonexistent}}\n")
    assert main(["generate", "--config", str(bad), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
