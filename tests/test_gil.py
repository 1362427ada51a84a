"""The GIL switch interval a deployment's processes set (serving/gil.py)."""

from __future__ import annotations

import sys

import pytest

from tokenrouter.serving.gil import DEFAULT_SWITCH_INTERVAL_MS, SWITCH_INTERVAL_ENV, set_switch_interval


@pytest.fixture(autouse=True)
def _restore_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_default_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SWITCH_INTERVAL_ENV, raising=False)
    assert set_switch_interval() == pytest.approx(DEFAULT_SWITCH_INTERVAL_MS / 1000)
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_SWITCH_INTERVAL_MS / 1000)
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, "5")
    assert set_switch_interval() == pytest.approx(0.005)


@pytest.mark.parametrize("raw", ["0", "-1", "fast", "nan", "inf"])
def test_bad_values_name_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, raw)
    before = sys.getswitchinterval()
    with pytest.raises(ValueError, match=SWITCH_INTERVAL_ENV):
        set_switch_interval()
    assert sys.getswitchinterval() == before  # nothing set
