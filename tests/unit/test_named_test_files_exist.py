"""Every test file the tests, the package or the docs point to (``tests/....py``) exists: a
pointer to a missing file sends a reader to tests that do not run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"tests/[A-Za-z0-9_/]+\.py")


def test_every_named_test_file_exists():
    sources = [*ROOT.glob("tests/**/*.py"), *ROOT.glob("vllm_dualgpu/**/*.py"), *ROOT.glob("docs/*.md"),
               ROOT / "README.md"]
    missing = sorted({f"{src.relative_to(ROOT)} names {name}"
                      for src in sources for name in NAMED.findall(src.read_text(errors="replace"))
                      if not (ROOT / name).exists()})
    assert missing == []
