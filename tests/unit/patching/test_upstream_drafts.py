"""Every registry entry says which upstream/ draft would retire it (or why none), each draft it
names exists with its patch and PR.md, and a draft's PR.md lists exactly the entries that name
it. upstream/check.sh is run through the shell on a made-up source: it passes a patch that
applies and fails one that does not."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from vllm_dualgpu.patching.interventions import INTERVENTIONS
from vllm_dualgpu.patching.registry import PATCHES

ROOT = Path(__file__).resolve().parents[3]
UPSTREAM = ROOT / "upstream"
ENTRIES = PATCHES + INTERVENTIONS


def draft_of(entry) -> str | None:
    m = re.match(r"upstream/([\w.-]+)", entry.upstream_draft)
    return m.group(1) if m else None


def retired_by(pr: Path) -> set[str]:
    """The entry names in backticks in PR.md's section on registry entries it retires."""
    text = pr.read_text()
    section = re.search(r"^## Registry entries.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, f"{pr} has no '## Registry entries ...' section"
    return set(re.findall(r"`([a-z0-9-]+)`", section.group(1)))


def test_every_entry_names_its_draft_or_why_none():
    missing = [e.name for e in ENTRIES if not e.upstream_draft.strip()]
    assert not missing, f"entries without upstream_draft: {missing}"


def test_named_drafts_exist_with_patch_and_pr():
    for entry in ENTRIES:
        name = draft_of(entry)
        if name is None:
            continue
        folder = UPSTREAM / name
        assert (folder / "PR.md").is_file(), f"{entry.name}: {folder}/PR.md missing"
        assert len(list(folder.glob("*.patch"))) == 1, f"{entry.name}: {folder} needs one .patch"


@pytest.mark.parametrize("folder", sorted(p.parent for p in UPSTREAM.glob("*/PR.md")),
                         ids=lambda p: p.name)
def test_pr_lists_the_entries_that_name_it(folder):
    naming = {e.name for e in ENTRIES if draft_of(e) == folder.name}
    assert naming, f"no registry entry names {folder.name}"
    assert retired_by(folder / "PR.md") == naming


def _sdist(tmp_path: Path, text: str) -> Path:
    tree = tmp_path / "vllm-0.33.0"
    tree.mkdir()
    (tree / "hello.txt").write_text(text + "\n")
    out = tmp_path / "vllm-0.33.0.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        tar.add(tree, arcname="vllm-0.33.0")
    return out


def _draft(tmp_path: Path, old: str, new: str) -> Path:
    drafts = tmp_path / "drafts"
    (drafts / "greeting").mkdir(parents=True)
    (drafts / "greeting" / "greeting.patch").write_text(
        "diff --git a/hello.txt b/hello.txt\n--- a/hello.txt\n+++ b/hello.txt\n"
        f"@@ -1 +1 @@\n-{old}\n+{new}\n")
    return drafts


def _check(tmp_path: Path, sdist: Path, drafts: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "UPSTREAM_CACHE": str(tmp_path / "cache"),
           "UPSTREAM_SDIST": str(sdist), "UPSTREAM_DRAFTS": str(drafts)}
    return subprocess.run(["bash", str(UPSTREAM / "check.sh"), sys.executable], env=env,
                          capture_output=True, text=True, timeout=120)


def test_check_passes_a_patch_that_applies(tmp_path):
    result = _check(tmp_path, _sdist(tmp_path, "hello"), _draft(tmp_path, "hello", "hi"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "applies to vLLM 0.33.0: greeting/greeting.patch" in result.stdout
    # The unpacked source is cached and left as released.
    assert (tmp_path / "cache" / "vllm-0.33.0" / "hello.txt").read_text() == "hello\n"


def test_check_fails_a_patch_that_no_longer_applies(tmp_path):
    result = _check(tmp_path, _sdist(tmp_path, "hello"), _draft(tmp_path, "goodbye", "hi"))
    assert result.returncode == 1
    assert ("FAILED: greeting/greeting.patch no longer applies to vLLM 0.33.0's source"
            in result.stdout)
