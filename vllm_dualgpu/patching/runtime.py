"""What a dualgpu run will do on a given vLLM release, as the plan must assume it.

The planner is pure and knows nothing of patches; but some patches change what a rank holds
(a drafter that shares the target's embedding holds no copy of it; a later rank that builds no
vision tower holds no vision weights) or how the KV cache is grouped. ``vllm-dualgpu plan``
(offline) and the executor (in a run) both ask :func:`runtime_assumptions` for the installed
vLLM, so they plan for the same runtime. The answer is derived from the registry: a patch
counts for a release when it is declared and its range holds that release; a behaviour vLLM
itself gained counts from the release named in :data:`UPSTREAM_FROM`.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Behaviours a registry patch gives older releases and vLLM has itself from this release on.
UPSTREAM_FROM = {
    # vLLM 0.33's _mark_tower_model builds the vision tower on the first PP rank only with the
    # V2 model runner (model_executor/models/interfaces.py), for every executor.
    "vision-tower-first-rank-only": "0.33.0",
}


@dataclass(frozen=True)
class RuntimeAssumptions:
    vllm_version: str
    drafter_shares_embedding: bool
    """The MTP/EAGLE drafter on the last rank uses the target's embedding (holds no copy)."""
    vision_tower_first_rank_only: bool
    """Only rank 0 holds the vision tower's weights."""
    kv_grouping: str
    """"dualgpu" when the plugin's KV grouping patches are in force, else "stock"."""
    flashinfer_workspace_bytes: int | None = None
    """vLLM's VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE where the user set it (the size FlashInfer
    allocates); None: the executor sets it (the intervention "flashinfer-workspace-size",
    :func:`vllm_dualgpu.planner.memory.plugin_flashinfer_workspace`)."""

    def request_fields(self) -> dict:
        """The :class:`vllm_dualgpu.planner.PlanRequest` fields these assumptions decide."""
        fields = {
            "drafter_shares_embedding": self.drafter_shares_embedding,
            "vision_on_every_rank": not self.vision_tower_first_rank_only,
            "kv_grouping": self.kv_grouping,
        }
        from vllm_dualgpu.planner.memory import MemoryModel

        if self.flashinfer_workspace_bytes is not None:
            fields["memory"] = MemoryModel(flashinfer_workspace_bytes=self.flashinfer_workspace_bytes)
        else:
            fields["memory"] = MemoryModel(flashinfer_workspace_sized=True)
        return fields

    def describe(self) -> str:
        fi = (", FlashInfer workspace sized by the executor" if self.flashinfer_workspace_bytes is None else
              f", FlashInfer workspace {self.flashinfer_workspace_bytes / 2**20:.0f} MiB "
              "(VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE)")
        return (f"vLLM {self.vllm_version}: drafter "
                f"{'shares' if self.drafter_shares_embedding else 'copies'} the target embedding, "
                f"vision tower on {'rank 0 only' if self.vision_tower_first_rank_only else 'every rank'}, "
                f"{self.kv_grouping} KV grouping{fi}")


def in_force(name: str, version: str, patches=None) -> bool:
    """Whether the registry declares patch ``name`` for ``version`` (or vLLM has it itself)."""
    from vllm_dualgpu.patching.core import version_in_range
    from vllm_dualgpu.patching.registry import PATCHES

    declared = [p for p in (PATCHES if patches is None else patches) if p.name == name]
    if any(version_in_range(version, p.vllm_versions) for p in declared):
        return True
    since = UPSTREAM_FROM.get(name)
    return since is not None and version_in_range(version, f">={since}")


def runtime_assumptions(vllm_version: str | None = None, patches=None) -> RuntimeAssumptions:
    """The assumptions for ``vllm_version`` (default: the installed vLLM, else the newest
    supported release, which a fresh install gets)."""
    from vllm_dualgpu.envs import flashinfer_workspace_bytes
    from vllm_dualgpu.support import CHECKED_RELEASES, installed_vllm_version, is_supported

    installed = installed_vllm_version()
    if installed is not None and not is_supported(installed):
        installed = None  # the dualgpu backend refuses it: plan for what a fresh install gets
    version = vllm_version or installed or CHECKED_RELEASES[-1]
    # vLLM 0.33 moved KV planning to another module: the same patches carry a "-033" suffix there
    kv = all(in_force(n, version, patches) or in_force(f"{n}-033", version, patches)
             for n in ("kv-groups-know-ranks", "kv-groups-without-padding"))
    return RuntimeAssumptions(
        vllm_version=version,
        drafter_shares_embedding=in_force("drafter-shares-target-embed", version, patches),
        vision_tower_first_rank_only=in_force("vision-tower-first-rank-only", version, patches),
        kv_grouping="dualgpu" if kv else "stock",
        flashinfer_workspace_bytes=flashinfer_workspace_bytes(),
    )
