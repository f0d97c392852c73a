"""No two entries of one family (a name, and that name with a release suffix such as "-033") are
in force for one release: ``registry.for_version`` answers a family with its first match, and the
GPU tests (``gpu_harness.patches_in_force``) and the docs' support table rely on there being one."""

from __future__ import annotations

from vllm_dualgpu.patching.core import version_in_range
from vllm_dualgpu.patching.registry import PATCHES, family
from vllm_dualgpu.support import CHECKED_RELEASES


def test_each_family_has_at_most_one_entry_per_release():
    doubled = {}
    for version in CHECKED_RELEASES:
        for name in {family(p.name) for p in PATCHES}:
            entries = [p.name for p in PATCHES if family(p.name) == name and version_in_range(version, p.vllm_versions)]
            if len(entries) > 1:
                doubled[(name, version)] = entries
    assert not doubled, f"families with more than one entry in force: {doubled}"
