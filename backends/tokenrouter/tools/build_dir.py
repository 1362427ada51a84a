"""Build a generated directory next to its target and move it into place in one step."""

from __future__ import annotations

import pathlib
import shutil
import uuid
from collections.abc import Callable


def build_dir(out_dir: pathlib.Path, build: Callable[[pathlib.Path], None], manifest: str, what: str) -> None:
    """Run `build(tmp)` in a fresh sibling folder of `out_dir`, then rename it to `out_dir`.

    Readers never see a half-written directory: `build` writes `manifest` last, and only a finished folder
    is renamed into place. An existing `out_dir` is replaced only if it carries `manifest` (so it is ours,
    even if outdated); anything else there is refused rather than deleted. `what` names the generator in
    that error.
    """
    out_dir = out_dir.absolute()
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / manifest).exists():
        raise FileExistsError(f"{out_dir} exists and does not look like a {what} output")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Same filesystem as the target, so moving it into place is a rename.
    tmp = out_dir.parent / f".{out_dir.name}.building-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        build(tmp)
        if out_dir.exists():
            # rename() cannot replace a non-empty directory, so move the old one aside.
            old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
