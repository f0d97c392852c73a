"""KV-cache arithmetic, mirroring vLLM 0.30 (``vllm/v1/core/kv_cache_utils.py``).

This is the pure mirror ``vllm-dualgpu plan`` uses, including the grouping the package's KV
patches choose under the dualgpu executor (planner/kv_grouping.py). The executor,
where vLLM is loaded, prices it again with vLLM's own (patched) functions
(:meth:`KVLayout.regrouped`, engine/kv_pricing.py) and must find the same groups.

What vLLM does, and what this module reproduces without importing it:

* Every attention layer has a page of ``block_size x num_kv_heads x (head_dim + head_dim) x
  dtype bytes`` (``FullAttentionSpec``); a Gated DeltaNet layer has one state page: conv state
  ``conv_dim x (kernel - 1 + num_speculative_tokens)`` plus the recurrent state
  ``num_v_heads x v_head_dim x k_head_dim`` (``MambaSpec``).
* Hybrid models: before the specs are built, ``Platform._align_hybrid_block_size`` raises the
  attention block size to ``align * cdiv(mamba_page, align * attention_bytes_per_token)`` and
  pads the mamba page to the attention page. Drafter layers with another page size are then
  unified by ``unify_kv_cache_spec_page_size`` (integer block-size ratio, else padding).
* Grouping (``get_kv_cache_groups``): one group when every layer has the same spec (or the
  same type, ``UniformTypeKVCacheSpecs``); otherwise layers are bucketed by spec, the group
  size is the smallest bucket (or the largest when it is < 1.5x the smallest), and bucket
  ``b`` is split into ``cdiv(len(b), size)`` groups ``b[i::n]``. Groups alias the same memory.
* Per pipeline rank, one block costs the largest group's page bytes among that rank's layers
  (``_get_kv_cache_bytes_per_block`` after ``_project_kv_cache_groups_to_worker``); the rank
  holds ``available // bytes_per_block`` blocks, and every rank then uses the minimum.
* A request of ``L`` tokens needs ``cdiv(L, block_size)`` blocks per attention group plus
  ``1 + num_speculative_tokens`` (``2 + ...`` with prefix caching, mamba "align" mode) per
  mamba group, plus ``cdiv(min(window - 1 + in-flight tokens, L), block_size) + 1`` per
  sliding-window group (a DFlash drafter's ``SlidingWindowSpec``); one block is the pool's null
  block.

This follows the default layer-major KV layout (``LBNHC``) that FlashAttention and FlashInfer
resolve to on CUDA; block-outermost layouts pack mixed page sizes differently.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from vllm_dualgpu.planner.errors import BadRequest, UnsupportedModel
from vllm_dualgpu.planner.formats import cdiv
from vllm_dualgpu.planner.model import FULL, LINEAR, DrafterSpec, ModelSpec

#: vLLM's ``CacheConfig.DEFAULT_BLOCK_SIZE``, and what FlashAttention/FlashInfer prefer.
DEFAULT_BLOCK_SIZE = 16
#: Smallest kernel block of FlashAttention (``MultipleOf(16)``) and FlashInfer (``[16, 32, 64]``).
DEFAULT_KERNEL_BLOCK_ALIGNMENT = 16

_KV_DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float32": 4,
    "float": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "int8": 1,
}

# vLLM's CacheDType names (vllm/config/cache.py, 0.30-0.33) that the planner does not size:
# --kv-cache-dtype with one of these is a request it cannot plan (exit 1), any other unknown
# name a bad argument (exit 2).
VLLM_CACHE_DTYPES = frozenset((
    "fp8_ds_mla", "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
    "turboquant_3bit_nc", "octave_k3v4", "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit",
    "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head",
    "nvfp4", "nvfp4_4over6",
))


def dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes per element of a KV-cache dtype name (``"auto"`` means the model dtype)."""
    d = (kv_cache_dtype or "auto").lower()
    if d == "auto":
        d = (model_dtype or "bfloat16").lower().replace("torch.", "")
    try:
        return _KV_DTYPE_BYTES[d]
    except KeyError:
        pass
    if (kv_cache_dtype or "").lower() in VLLM_CACHE_DTYPES:  # vLLM knows it; the planner cannot size it
        raise UnsupportedModel(
            f"the planner does not size --kv-cache-dtype {kv_cache_dtype!r}; use auto, bfloat16, "
            "float16 or fp8"
        )
    raise BadRequest(
        f"--kv-cache-dtype {kv_cache_dtype!r} is not a KV-cache dtype vLLM knows; write auto, "
        "bfloat16, float16, fp8, fp8_e4m3 or fp8_e5m2"
    )


@dataclass(frozen=True)
class KVSlot:
    """One layer's KV-cache page, as vLLM's spec for it ends up after page-size unification."""

    name: str
    kind: str  # "attention" or "mamba"
    layer_index: int | None  # target decoder layer; None for drafter layers (last rank)
    page_bytes: int
    tokens_per_block: int  # attention: block size of this layer's spec; mamba: 0
    spec_key: tuple
    real_bytes_per_token: int = 0  # attention: unpadded K+V bytes per token
    state_bytes: int = 0  # mamba: unpadded state bytes
    window_tokens: int = 0
    """Sliding-window attention: the tokens one request keeps (window - 1 + the tokens in flight,
    ``SlidingWindowSpec.max_admission_blocks_per_request``); 0 for full attention."""
    sliding_window: int = 0  # sliding-window attention: the window itself


@dataclass(frozen=True)
class PricedGroup:
    """One KV cache group as vLLM formed it: its layers, their page bytes, its block size
    (attention) or the blocks one request takes (mamba). Plain data, so the planner stays pure."""

    kind: str  # "attention" or "mamba"
    layer_names: tuple[str, ...]
    page_bytes: dict[str, int]
    tokens_per_block: int = 0
    blocks_per_request_const: int = 0
    window_tokens: int = 0  # sliding-window attention: see KVSlot.window_tokens


@dataclass(frozen=True)
class KVGroup:
    kind: str
    members: tuple[int, ...]  # indices into KVLayout.slots
    tokens_per_block: int = 0  # attention groups
    blocks_per_request_const: int = 0  # mamba groups
    window_tokens: int = 0  # sliding-window attention groups: see KVSlot.window_tokens

    def blocks_per_request(self, max_len: int) -> int:
        """Blocks one request of ``max_len`` tokens takes in this group (vLLM's specs'
        ``max_memory_usage_bytes`` in pages)."""
        if self.window_tokens and self.tokens_per_block:  # SlidingWindowSpec
            return cdiv(min(self.window_tokens, max_len), self.tokens_per_block) + 1
        if self.tokens_per_block:
            return cdiv(max_len, self.tokens_per_block)
        return self.blocks_per_request_const


@dataclass
class KVLayout:
    """The KV cache of one model + drafter under one set of cache settings.

    ``bytes_per_block(start, end, last)`` is what one block costs the rank holding target
    layers ``[start, end)`` (plus the drafter if ``last``); ``blocks_per_request(L)`` is what one
    request of ``L`` tokens takes from the shared pool.
    """

    model_name: str
    num_layers: int
    block_size: int
    kv_cache_dtype: str
    attn_bytes_per_token: int
    mamba_page_bytes: int  # unpadded state page (0 for dense models)
    mamba_page_padded: int  # what vLLM pads it to (0 for dense models)
    mamba_cache_mode: str
    num_speculative_tokens: int
    slots: list[KVSlot]
    groups: list[KVGroup]
    grouping: str  # "uniform", "uniform-type", "hybrid", or "vllm" (see regrouped)
    notes: list[str] = field(default_factory=list)
    raw_slots: list[KVSlot] = field(default_factory=list)
    """Each layer's page before page sizes are unified: what vLLM's layers report."""
    stock_groups: list[KVGroup] = field(default_factory=list)
    """Stock vLLM's grouping of a hybrid layout (what planner/kv_grouping.py starts from)."""
    # prefix sums per group over target layer index; drafter part per group
    _prefix: list[list[int]] = field(default_factory=list, repr=False)
    _drafter: list[int] = field(default_factory=list, repr=False)

    # ---- per rank -------------------------------------------------------------------------

    def bytes_per_block(self, start: int, end: int, last: bool) -> int:
        """Bytes one block costs the rank with target layers ``[start, end)`` (+ drafter if last)."""
        best = 0
        for g, pref in enumerate(self._prefix):
            b = pref[end] - pref[start] + (self._drafter[g] if last else 0)
            if b > best:
                best = b
        return best

    def layer_names(self, start: int, end: int, last: bool) -> list[str]:
        return [
            s.name
            for s in self.slots
            if (s.layer_index is not None and start <= s.layer_index < end) or (s.layer_index is None and last)
        ]

    # ---- per request ----------------------------------------------------------------------

    @property
    def blocks_per_request_const(self) -> int:
        return sum(g.blocks_per_request_const for g in self.groups)

    def blocks_per_request(self, max_len: int) -> int:
        """Blocks one request of ``max_len`` tokens takes (sum over groups, as vLLM counts)."""
        return sum(g.blocks_per_request(max_len) for g in self.groups)

    def max_len_for_blocks(self, num_blocks: int) -> int:
        """Largest request length whose blocks fit in a pool of ``num_blocks`` (one is the null block)."""
        usable = num_blocks - 1
        if usable < self.blocks_per_request(1):
            return 0
        lo, hi = 1, max(1, usable) * max((g.tokens_per_block for g in self.groups if g.tokens_per_block),
                                           default=1) + 1
        while lo < hi:  # largest L with blocks_per_request(L) <= usable
            mid = (lo + hi + 1) // 2
            if self.blocks_per_request(mid) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def pool_tokens(self, num_blocks: int, max_model_len: int) -> int:
        """vLLM's "GPU KV cache size: N tokens" (concurrency at max_model_len x max_model_len)."""
        per_req = self.blocks_per_request(max_model_len)
        return int(num_blocks / per_req * max_model_len) if per_req else 0

    def bytes_per_token_read(self, start: int, end: int, last: bool) -> tuple[int, int]:
        """(K+V bytes read per context token, mamba state bytes) for a rank's layers, unpadded."""
        per_tok = state = 0
        for s in self.slots:
            on = (s.layer_index is not None and start <= s.layer_index < end) or (s.layer_index is None and last)
            if on:
                per_tok += s.real_bytes_per_token
                state += s.state_bytes
        return per_tok, state

    def describe(self) -> dict:
        return {
            "block_size": self.block_size,
            "kv_cache_dtype": self.kv_cache_dtype,
            "attention_bytes_per_token_per_layer": self.attn_bytes_per_token,
            "mamba_page_bytes": self.mamba_page_bytes,
            "mamba_page_padded_bytes": self.mamba_page_padded,
            "mamba_cache_mode": self.mamba_cache_mode,
            "grouping": self.grouping,
            "groups": [
                {"kind": g.kind, "layers": len(g.members), "page_bytes": self.slots[g.members[0]].page_bytes}
                for g in self.groups
            ],
            "notes": list(self.notes),
        }

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        model: ModelSpec,
        *,
        kv_cache_dtype: str = "auto",
        block_size: int | None = None,
        drafter: DrafterSpec | None = None,
        num_speculative_tokens: int | None = None,
        model_dtype: str | None = None,
        mamba_cache_dtype: str = "auto",
        mamba_ssm_cache_dtype: str = "auto",
        mamba_cache_mode: str = "align",
        kernel_block_alignment: int = DEFAULT_KERNEL_BLOCK_ALIGNMENT,
        max_in_flight_tokens: int = 0,
    ) -> "KVLayout":
        """``max_in_flight_tokens``: vLLM's ``VllmConfig.max_in_flight_tokens`` (concurrent
        batches x ``max_num_batched_tokens``), what a sliding-window drafter layer keeps beyond
        its window."""
        mdt = model.run_dtype(model_dtype)
        num_spec = num_speculative_tokens if num_speculative_tokens is not None else (
            drafter.num_speculative_tokens if drafter else 0
        )
        kvb = dtype_bytes(kv_cache_dtype, mdt)
        attn_tok = model.num_kv_heads * 2 * model.head_dim * kvb
        notes: list[str] = []
        if block_size is not None and block_size <= 0:
            raise BadRequest("--block-size must be positive")
        bs = block_size or DEFAULT_BLOCK_SIZE

        mamba_page = mamba_padded = 0
        if model.is_hybrid:
            g = model.linear
            assert g is not None
            if mamba_cache_mode == "all":
                raise UnsupportedModel(
                    f"{model.name}: mamba cache mode 'all' is not supported by vLLM for this model; "
                    "use 'align' (the default with prefix caching) or 'none'"
                )
            conv_b = dtype_bytes(mamba_cache_dtype, mdt)
            ssm = mamba_ssm_cache_dtype
            if ssm == "auto" and model.mamba_ssm_dtype != "auto":
                ssm = model.mamba_ssm_dtype  # Qwen3.5: the config's mamba_ssm_dtype
            ssm_b = conv_b if ssm == "auto" else dtype_bytes(ssm, mdt)
            conv = g.conv_dim * (g.conv_kernel - 1 + num_spec) * conv_b
            temporal = g.num_v_heads * g.v_head_dim * g.k_head_dim * ssm_b
            mamba_page = conv + temporal
            align = max(kernel_block_alignment, bs)
            attn_block = align * cdiv(mamba_page, align * attn_tok)
            if bs < attn_block:
                notes.append(
                    f"attention block size raised to {attn_block} tokens so a page holds a "
                    f"{mamba_page:,}-byte Gated DeltaNet state (vLLM's hybrid alignment)"
                )
                bs = attn_block
            mamba_padded = bs * attn_tok
            assert mamba_padded >= mamba_page

        slots: list[KVSlot] = []
        a_key = ("attn", model.num_kv_heads, model.head_dim, kvb, bs, None)
        m_key = ("mamba", mamba_padded)
        for i, kind in enumerate(model.layer_types):
            if kind == FULL:
                slots.append(
                    KVSlot(f"model.layers.{i}.self_attn.attn", "attention", i, bs * attn_tok, bs, a_key, attn_tok)
                )
            elif kind == LINEAR:
                slots.append(KVSlot(f"model.layers.{i}.linear_attn", "mamba", i, mamba_padded, 0, m_key, 0, mamba_page))
        if drafter is not None and drafter.kv_layers:
            dkvb = dtype_bytes(drafter.kv_cache_dtype or kv_cache_dtype, mdt)
            d_tok = drafter.kv_heads * 2 * drafter.head_dim * dkvb
            window = drafter.sliding_window
            # a sliding-window layer has its own spec (SlidingWindowSpec): its own bucket
            d_key = ("swa" if window else "attn", drafter.kv_heads, drafter.head_dim, dkvb, bs, None)
            keep = window - 1 + max_in_flight_tokens if window else 0
            for j in range(drafter.kv_layers):
                slots.append(
                    KVSlot(f"drafter.layers.{j}.self_attn.attn", "attention", None, bs * d_tok, bs, d_key, d_tok,
                           window_tokens=keep, sliding_window=window)
                )

        raw_slots = list(slots)
        keys = {s.spec_key for s in slots}
        kinds = {s.kind for s in slots}
        if any(s.window_tokens for s in slots) and not model.is_hybrid:
            raise UnsupportedModel(
                f"{model.name}: a sliding-window drafter next to a model without Gated DeltaNet "
                "layers is not sized by the planner yet")
        if len(keys) == 1:
            groups = [KVGroup("attention" if "attention" in kinds else "mamba", tuple(range(len(slots))), bs)]
            grouping = "uniform"
            if kinds == {"mamba"}:
                raise UnsupportedModel(f"{model.name}: attention-free models are not sized by the planner")
        elif kinds == {"attention"}:
            # UniformTypeKVCacheSpecs: one group, each layer keeps its own page size
            groups = [KVGroup("attention", tuple(range(len(slots))), bs)]
            grouping = "uniform-type"
        else:
            slots = _unify_page_sizes(slots)
            groups = _hybrid_groups(slots, mamba_cache_mode, num_spec)
            grouping = "hybrid"
            sizes = sorted({len(g.members) for g in groups})
            if len(sizes) > 1:
                notes.append(
                    f"vLLM groups the {len(slots)} KV layers into {len(groups)} groups of "
                    f"{'/'.join(map(str, sizes))} layers; every block is sized for the largest group, "
                    "so blocks held by smaller groups are partly unused"
                )
            target_keys = {s.spec_key for s in raw_slots if s.layer_index is not None}
            if any(s.layer_index is None and s.spec_key not in target_keys for s in raw_slots):
                notes.append(
                    "the drafter's attention layers have their own KV spec: stock vLLM then cuts "
                    f"every group to their count ({len(groups)} groups here); with PP > 1 the "
                    "dualgpu executor groups them with less padding (its KV patches) and prices "
                    "that with vLLM's own functions, so the pool it logs can be larger than this"
                )

        layout = cls(
            model_name=model.name,
            num_layers=model.num_layers,
            block_size=bs,
            kv_cache_dtype=kv_cache_dtype,
            attn_bytes_per_token=attn_tok,
            mamba_page_bytes=mamba_page,
            mamba_page_padded=mamba_padded,
            mamba_cache_mode=mamba_cache_mode if model.is_hybrid else "none",
            num_speculative_tokens=num_spec,
            slots=slots,
            groups=groups,
            grouping=grouping,
            notes=notes,
            raw_slots=raw_slots,
            stock_groups=list(groups) if grouping == "hybrid" else [],
        )
        layout._index()
        return layout

    def regrouped(self, groups: list[PricedGroup]) -> KVLayout:
        """This layout with another grouping: vLLM's, as its (patched) functions formed it from
        these layers' specs. Every layer is in exactly one group and takes that group's page
        bytes and block size; per-token reads (decode cost) stay this layout's."""
        index = {s.name: i for i, s in enumerate(self.slots)}
        seen: set[str] = set()
        slots = list(self.slots)
        new_groups = []
        for g in groups:
            unknown = [n for n in g.layer_names if n not in index]
            if unknown or seen & set(g.layer_names):
                raise ValueError(f"group {g.layer_names[:3]}...: layers unknown to the planner or in two groups: "
                                 f"{unknown or sorted(seen & set(g.layer_names))}")
            seen.update(g.layer_names)
            for n in g.layer_names:
                s = slots[index[n]]
                slots[index[n]] = _replace(s, page_bytes=g.page_bytes.get(n, s.page_bytes),
                                           tokens_per_block=g.tokens_per_block if s.kind == "attention" else 0,
                                           window_tokens=g.window_tokens if s.kind == "attention" else 0)
            new_groups.append(KVGroup(g.kind, tuple(index[n] for n in g.layer_names),
                                      g.tokens_per_block if g.kind == "attention" else 0,
                                      g.blocks_per_request_const if g.kind == "mamba" else 0,
                                      g.window_tokens if g.kind == "attention" else 0))
        missing = [s.name for s in self.slots if s.name not in seen]
        if missing:
            raise ValueError(f"layers in no group: {missing[:3]} ({len(missing)} in all)")
        layout = replace(self, slots=slots, groups=new_groups, grouping="vllm", notes=list(self.notes),
                         raw_slots=list(self.raw_slots))
        layout._index()
        return layout

    def same_grouping(self, other: KVLayout) -> bool:
        """Whether ``other`` groups the same layers together with the same pages and blocks."""
        def key(lay: KVLayout):
            return sorted(
                (g.kind, g.tokens_per_block, g.blocks_per_request_const, g.window_tokens,
                 tuple(sorted((lay.slots[m].name, lay.slots[m].page_bytes) for m in g.members)))
                for g in lay.groups
            )
        return key(self) == key(other)

    def _index(self) -> None:
        L = self.num_layers
        self._prefix = []
        self._drafter = []
        for g in self.groups:
            per_layer = [0] * L
            drafter = 0
            for m in g.members:
                s = self.slots[m]
                if s.layer_index is None:
                    drafter += s.page_bytes
                else:
                    per_layer[s.layer_index] += s.page_bytes
            pref = [0] * (L + 1)
            for i in range(L):
                pref[i + 1] = pref[i] + per_layer[i]
            self._prefix.append(pref)
            self._drafter.append(drafter)


def _unify_page_sizes(slots: list[KVSlot]) -> list[KVSlot]:
    """``unify_kv_cache_spec_page_size``: scale smaller attention pages by an integer block-size
    ratio when it divides the largest page, otherwise pad; pad mamba pages."""
    max_page = max(s.page_bytes for s in slots)
    out = []
    for s in slots:
        if s.page_bytes == max_page:
            out.append(s)
        elif s.kind == "mamba":
            out.append(_replace(s, page_bytes=max_page, spec_key=("mamba", max_page)))
        elif max_page % s.page_bytes == 0:
            ratio = max_page // s.page_bytes
            key = s.spec_key[:4] + (s.tokens_per_block * ratio, None)
            out.append(_replace(s, page_bytes=max_page, tokens_per_block=s.tokens_per_block * ratio, spec_key=key))
        else:
            key = s.spec_key[:5] + (max_page,)
            out.append(_replace(s, page_bytes=max_page, spec_key=key))
    return out


def _replace(s: KVSlot, **kw) -> KVSlot:
    return replace(s, **kw)


def _hybrid_groups(slots: list[KVSlot], mamba_cache_mode: str, num_spec: int) -> list[KVGroup]:
    """``_get_kv_cache_groups_uniform_page_size``: bucket by spec, equal-size strided groups."""
    buckets = spec_buckets(slots)
    lens = [len(b) for b in buckets]
    group_size = min(lens)
    if max(lens) < min(lens) * 1.5:
        group_size = max(lens)
    return strided_groups(slots, buckets, [cdiv(len(b), group_size) for b in buckets],
                          mamba_blocks(mamba_cache_mode, num_spec))


def spec_buckets(slots: list[KVSlot]) -> list[tuple[int, ...]]:
    """The slots' indices by spec, buckets in order of first appearance (vLLM's, as it walks
    the layers: rank by rank, which is model order, the drafter's last)."""
    buckets: dict[tuple, list[int]] = {}
    for i, s in enumerate(slots):
        buckets.setdefault(s.spec_key, []).append(i)
    return [tuple(b) for b in buckets.values()]


def mamba_blocks(mamba_cache_mode: str, num_spec: int) -> int:
    """Blocks one request takes in a Gated DeltaNet group ("align" mode keeps one more)."""
    return (2 if mamba_cache_mode == "align" else 1) + num_spec


def strided_groups(slots: list[KVSlot], buckets: list[tuple[int, ...]], counts, mamba_blocks_: int) -> list[KVGroup]:
    """Each bucket cut into ``counts[b]`` groups ``bucket[i::n]``, as vLLM cuts it."""
    groups: list[KVGroup] = []
    for members, n in zip(buckets, counts):
        for i in range(n):
            part = members[i::n]
            s0 = slots[part[0]]
            if s0.kind == "mamba":
                groups.append(KVGroup("mamba", part, 0, mamba_blocks_))
            else:
                groups.append(KVGroup("attention", part, s0.tokens_per_block, 0, s0.window_tokens))
    return groups
