"""The README's worked policy example runs as written, loaded through `policy.module`."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tokenrouter import Engine, SamplingParams

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_policy_example(tiny_dir: Path, tmp_path: Path, monkeypatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    source = next(b for b in blocks if "class EntropyEscalation" in b)
    pkg = tmp_path / "mypolicies"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "escalate.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = {
        "models": {m: {"path": str(tiny_dir / m), "kv_cache_tokens": 2048} for m in ("small", "large")},
        "entry": "small",
        # The tiny small model's normalized entropy sits around 0.988: this threshold routes about half.
        "policy": {"name": "entropy-escalation", "module": "mypolicies.escalate", "threshold": 0.9886, "span": 3},
    }
    with Engine.from_config(cfg) as engine:
        out = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))[0]
        assert out.stats["handoffs"] > 0 and out.stats["tokens_per_model"].get("large", 0) > 0
        assert len(out.token_ids) == 24
        engine.check_integrity()
    sys.modules.pop("mypolicies.escalate", None)
    sys.modules.pop("mypolicies", None)
