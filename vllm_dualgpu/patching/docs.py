"""Renders docs/patches.md from the registry and the declared interventions.

Run from the repository root: ``python -m vllm_dualgpu.patching.docs [--check] [PATH]``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from vllm_dualgpu._version import SUPPORTED_VLLM
from vllm_dualgpu.patching.interventions import INTERVENTIONS
from vllm_dualgpu.patching.registry import PATCHES

HEADER = """# Run-time patches

Generated from `vllm_dualgpu/patching/registry.py` and `vllm_dualgpu/patching/interventions.py` by `python -m vllm_dualgpu.patching.docs`;
do not edit by hand (a test fails when this file is stale).

Every patch is applied from one place (`vllm_dualgpu.plugin.register`), only in the processes it
names and only for the vLLM versions in its range. Before a patch changes anything it checks that
its target exists with the expected parameters and that every `from x import f` copy still holds
vLLM's original; if any check fails it changes nothing and the process logs why. Patched objects
carry a sentinel, so applying twice is harmless. Patches that change behaviour act only when the
`dualgpu` executor drives the run; with `mp`, `ray` or a class path vLLM behaves as stock. The
exceptions name an **Opt-out**: they fix vLLM's front end for every executor (the tool-call
parser fixes, docs/tool-calling.md) and setting that variable to 0 leaves them unapplied.
Processes: `frontend` (API server or the `LLM` caller), `engine` (EngineCore), `worker` (each
GPU worker, when vLLM loads plugins there) and `device` (a dualgpu worker once its CUDA device
is set, for targets whose module starts CUDA when imported; listed in the rank's summary line).

"""


INTERVENTIONS_HEADER = """
# Other interventions

What the package changes or relies on in vLLM without replacing an attribute: a native hook,
environment variables and config fields it sets, the worker class it swaps in, and private vLLM
functions and attributes it calls or reads. Each names the vLLM object its check resolves (with
the patches' own resolution and parameter check); an instance attribute, which exists only on a
live object, is checked in the source of the vLLM method that sets or reads it. A dualgpu run
checks the entries of each process at start and stops, saying why, when one does not hold (so
does a required patch that was skipped); `vllm-dualgpu doctor` lists them. Kinds:
`native-hook`, `environment`, `config`, `worker-class`, `private-api`; the process `cli` is the
package's own commands (checked by `doctor` only).

"""


def check_text(item) -> str:
    """What an intervention's check requires, in words."""
    if item.probe:
        module, fn = item.probe.split(":", 1)
        doc = " ".join((getattr(importlib.import_module(module), fn).__doc__ or "").split())
        return f"`{fn}`: {doc}"
    text = f"`{item.check_target}` exists"
    if item.params is not None:
        text += f" and takes `({', '.join(item.params)})`"
    if item.source_names:
        text += f"; its source uses {', '.join(f'`{n}`' for n in item.source_names)}"
    return text


def draft_text(draft: str) -> str:
    """An entry's ``upstream_draft`` in docs/patches.md: a draft's directory links its PR.md."""
    import re

    return re.sub(r"^upstream/([\w.-]+)", r"[`upstream/\1`](../upstream/\1/PR.md)", draft)


def render_interventions() -> str:
    out = [INTERVENTIONS_HEADER, f"{len(INTERVENTIONS)} intervention(s).\n"]
    for i in INTERVENTIONS:
        out.append(f"\n## `{i.name}`\n\n")
        out.append(f"- **Kind:** {i.kind}\n")
        out.append(f"- **Target:** `{i.target}`\n")
        out.append(f"- **Check:** {check_text(i)}\n")
        out.append(f"- **Processes:** {', '.join(i.processes)}\n")
        out.append(f"- **vLLM versions:** `{i.vllm_versions}`\n")
        out.append(f"- **Why:** {i.why}\n")
        out.append(f"- **Upstream:** {i.upstream}\n")
        out.append(f"- **Remove when:** {i.remove_when}\n")
        if i.upstream_draft:
            out.append(f"- **Upstream draft:** {draft_text(i.upstream_draft)}\n")
        if i.issue:
            out.append(f"- **Project issue:** {i.issue}\n")
    return "".join(out)


KV_PLANNER_NOTE = """
vLLM 0.33 adds an experimental pluggable KV-cache planner (`Platform.get_kv_cache_config_builder_cls`
returning a `KVCacheConfigBuilder`, vLLM PR #53558). The KV entries for 0.33 do not use it: its
grouping hook runs in EngineCore before memory is measured and sees neither the ranks nor their
memory (the grouping here is chosen by the tightest rank's memory), a plugin can select a builder
only by patching the platform's classmethod (itself a run-time patch), and overriding
`get_kv_cache_groups` would mean copying vLLM's private grouping code (HiSparse, packed groups,
hidden-state layers) instead of wrapping the two functions it calls. `kv-groups-know-ranks-033`
instead forms the groups again with vLLM's `get_global_kv_cache_groups` inside
`get_kv_cache_configs`, once memory is known.
"""


def _fixed_version(patch) -> str:
    return patch.fixed_in.split(":", 1)[0].strip()


def support_table() -> str:
    """Release x problem: which entry applies, or since when upstream made it unneeded."""
    from packaging.version import Version

    from vllm_dualgpu.patching.registry import family, for_version
    from vllm_dualgpu.support import CHECKED_RELEASES

    families = list(dict.fromkeys(family(p.name) for p in PATCHES))
    out = [
        "\n## Support by vLLM release\n\n",
        "Supported: vLLM `" + SUPPORTED_VLLM + "`, checked on " + ", ".join(CHECKED_RELEASES)
        + ". Each cell names the entry that applies on that release (`yes` = the entry of "
        "that name; a suffix names the entry for that release's API), `not needed since X` "
        "where upstream fixed the problem in release X (see the entry's **Fixed upstream**).\n\n",
        "| patch | " + " | ".join(CHECKED_RELEASES) + " |\n",
        "|---|" + "---|" * len(CHECKED_RELEASES) + "\n",
    ]
    for name in families:
        cells = []
        for release in CHECKED_RELEASES:
            entry = for_version(name, release)
            fixed = [p for p in PATCHES if family(p.name) == name and p.fixed_in
                     and Version(_fixed_version(p)) <= Version(release)]
            if entry is not None:
                cells.append("yes" if entry.name == name else f"`{entry.name}`")
            elif fixed:
                cells.append(f"not needed since {_fixed_version(fixed[0])}")
            elif name == "dualgpu-needs-supported-vllm":
                cells.append("only outside the range")
            else:
                cells.append("**missing**")
        out.append(f"| `{name}` | " + " | ".join(cells) + " |\n")
    out.append(KV_PLANNER_NOTE)
    return "".join(out)


def render() -> str:
    out = [HEADER, f"{len(PATCHES)} patch(es).\n", support_table()]
    for p in PATCHES:
        out.append(f"\n## `{p.name}`\n\n")
        out.append(f"- **Target:** `{p.target}` (parameters: `{', '.join(p.params)}`)\n")
        if p.copies:
            out.append(f"- **Also rebinds copies in:** {', '.join(f'`{c}`' for c in p.copies)}\n")
        out.append(f"- **Processes:** {', '.join(p.processes)}\n")
        out.append(f"- **vLLM versions:** `{p.vllm_versions}`\n")
        out.append(f"- **Required:** {'no (optional)' if p.optional else 'yes'}\n")
        if p.source_sha256:
            out.append(
                f"- **Source pinned:** sha256 `{p.source_sha256}` (the target's source this patch "
                "mirrors; any other is refused)\n"
            )
        if p.opt_out:
            out.append(f"- **Opt-out:** `{p.opt_out}=0` (applies under every executor otherwise)\n")
        out.append(f"- **Why:** {p.why}\n")
        out.append(f"- **Upstream:** {p.upstream}\n")
        out.append(f"- **Remove when:** {p.remove_when}\n")
        if p.fixed_in:
            out.append(f"- **Fixed upstream:** vLLM {p.fixed_in}; the range ends there\n")
        if p.upstream_draft:
            out.append(f"- **Upstream draft:** {draft_text(p.upstream_draft)}\n")
        if p.issue:
            out.append(f"- **Project issue:** {p.issue}\n")
    out.append(render_interventions())
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    paths = [a for a in argv if not a.startswith("--")]
    target = Path(paths[0] if paths else "docs/patches.md")
    text = render()
    if "--check" in argv:
        if not target.exists() or target.read_text() != text:
            print(f"{target} is stale: run python -m vllm_dualgpu.patching.docs", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
