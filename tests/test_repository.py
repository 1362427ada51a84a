"""The model repository writer, and the checked-in default repository staying in sync with it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tokenrouter.serving.repository import write_repository

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "config" / "r2r" / "pair-small_pair-large.yaml"


def _tree(root: Path) -> dict[str, object]:
    """Files under root; model.json with its config path resolved, so trees at any depth compare."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(root))
            if p.name == "model.json":
                settings = json.loads(p.read_text())
                settings["config"] = str((p.parent / settings["config"]).resolve())
                out[rel] = settings
            else:
                # The execution environment is written relative to the model folder: compare where it points.
                out[rel] = re.sub(
                    r"\$\$TRITON_MODEL_DIRECTORY/([^\"]+)",
                    lambda m, folder=p.parent: str((folder / m.group(1)).resolve()),
                    p.read_text(),
                )
    return out


def test_checked_in_repository_is_the_generated_one(tmp_path: Path) -> None:
    out = write_repository(DEFAULT, tmp_path / "model_repository", execution_env=REPO / ".venv")
    assert _tree(out) == _tree(REPO / "model_repository")
    assert "EXECUTION_ENV_PATH" in (out / "small" / "config.pbtxt").read_text()


def test_settings_point_at_the_config_and_roles(tmp_path: Path) -> None:
    out = write_repository(DEFAULT, tmp_path / "repo")
    router = json.loads((out / "tokenrouter" / "1" / "model.json").read_text())
    assert router["role"] == "router"
    assert (out / "tokenrouter" / "1" / router["config"]).resolve() == DEFAULT.resolve()
    for name in ("small", "large"):
        s = json.loads((out / name / "1" / "model.json").read_text())
        assert s == {"role": "subserver", "config": router["config"], "model": name}
        assert "KIND_CPU" in (out / name / "config.pbtxt").read_text()


def test_gpu_placement_and_stale_models(tmp_path: Path, bench_tokenizer_dir: Path) -> None:
    cfg = yaml.safe_load((REPO / "config" / "mixture" / "qwen3-0.6b_qwen3-8b_qwen3-32b.yaml").read_text())
    for m in cfg["models"].values():
        m["path"] = str((REPO / "config" / "mixture" / m["path"]).resolve())
    cfg["tokenizer"] = str(bench_tokenizer_dir)
    cfg["models"]["large"]["device"] = "cuda:1"
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    out = write_repository(path, tmp_path / "repo")
    assert "gpus: [1]" in (out / "large" / "config.pbtxt").read_text()
    assert "gpus: [0]" in (out / "small" / "config.pbtxt").read_text()
    # Re-writing a two-model deployment into the same folder removes the third model.
    write_repository(DEFAULT, out)
    assert sorted(p.name for p in out.iterdir()) == ["large", "small", "tokenrouter"]


def test_router_name_is_reserved(tmp_path: Path, tiny_dir: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"models": {"tokenrouter": {"path": str(tiny_dir / "small")}}}))
    with pytest.raises(ValueError, match="may not be named"):
        write_repository(path, tmp_path / "repo")


def test_peer_gateway_names_are_reserved(tmp_path: Path, tiny_dir: Path) -> None:
    """`large` with a url is served behind the gateway `peer_large`: a model of that name would take its place."""
    models = {"small": {"path": str(tiny_dir / "small")},
              "large": {"path": str(tiny_dir / "large"), "url": "127.0.0.1:9001"},
              "peer_large": {"path": str(tiny_dir / "small")}}
    path = tmp_path / "clash.yaml"
    path.write_text(yaml.safe_dump({"models": models, "entry": "small"}, sort_keys=False))
    for peer in (False, True):
        with pytest.raises(ValueError, match=r"\['peer_large'\] are the peer gateways' names"):
            write_repository(path, tmp_path / "repo", peer=peer)
