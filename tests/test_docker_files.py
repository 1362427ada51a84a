"""The container files (docker/): no Docker daemon runs here, so what can be checked without one is: the
compose files parse, every path they name inside the image exists in this repository (COPY . puts it at
/opt/tokenrouter), the two-node servers get the keepalive flags `tokenrouter serve` uses, and
make_repository.py writes each node's repository for the two-node deployment."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest
import yaml

from tokenrouter.transport.grpc_link import keepalive_flags

REPO = Path(__file__).resolve().parents[1]
COMPOSE = [REPO / "docker" / "compose.yaml", REPO / "docker" / "compose.two-node.yaml"]
TWO_NODE = REPO / "config" / "two-node" / "r2r_pair-docker.yaml"


@pytest.mark.parametrize("path", COMPOSE, ids=lambda p: p.name)
def test_compose_paths_exist_in_the_image(path: Path) -> None:
    text = path.read_text()
    yaml.safe_load(text)
    named = set(re.findall(r"/opt/tokenrouter/([\w./-]+)", text))
    assert named
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"{path.name} names files the image does not have: {missing}"


def test_two_node_servers_accept_keepalive_pings() -> None:
    services = yaml.safe_load(COMPOSE[1].read_text())["services"]
    for name in ("peer", "server"):
        assert set(keepalive_flags()) <= set(services[name]["command"]), name


def _make_repository(args: list[str]) -> None:
    argv = sys.argv
    sys.argv = ["make_repository.py", *args]
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(REPO / "docker" / "make_repository.py"), run_name="__main__")
        assert done.value.code == 0
    finally:
        sys.argv = argv


def test_make_repository_writes_each_nodes_repository(tmp_path: Path) -> None:
    _make_repository(["--peer", str(TWO_NODE), str(tmp_path / "peer")])
    _make_repository([str(TWO_NODE), str(tmp_path / "router")])
    models = lambda repo: sorted(d.name for d in repo.iterdir() if (d / "config.pbtxt").is_file())  # noqa: E731
    assert models(tmp_path / "peer") == ["large", "peer_large"]
    assert models(tmp_path / "router") == ["small", "tokenrouter"]
