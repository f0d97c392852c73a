"""The package's KV grouping for one split (:func:`per_rank_grouping`), cheap enough to be asked
for every split the search prices (:class:`SplitGrouping`).

The patches (patches/kv_cache_utils.choose_grouping) choose among vLLM's own grouping and, for
each cap of 1, 2, ... layers per rank, the grouping that cuts every spec bucket into the fewest
groups ``bucket[i::n]`` holding at most that many of any rank's layers. A bucket lists its
layers rank by rank, which is model order (a rank holds consecutive layers; the drafter's come
last, on the last rank), so a capped grouping is fixed by its group count per bucket whatever
the split, and a rank's layers of a bucket are a run of it: of ``c`` layers on a rank, one of
the ``n`` groups holds at most ``cdiv(c, n)``. A grouping's cost on a split (the share of the
tightest rank's KV memory one request needs) is then a few integer operations per bucket and
rank, and only the grouping that wins is built as a layout, once per group counts.
"""

from __future__ import annotations

from dataclasses import replace

from vllm_dualgpu.planner.formats import cdiv
from vllm_dualgpu.planner.kv import KVLayout, mamba_blocks, spec_buckets, strided_groups


def per_rank_grouping(layout: KVLayout, partition, memory, max_model_len: int) -> KVLayout:
    """The grouping the package's KV patches give ``layout``'s layers under the dualgpu executor
    with PP > 1 (patches/kv_cache_utils.choose_grouping, kv-groups-without-padding): among vLLM's
    own grouping (the layout's stock groups) and groupings that cut each spec bucket into the
    fewest groups holding at most ``cap`` layers on any one rank (``b[i::n]``, layers rank by
    rank), none with more groups than vLLM's, the one whose ``max_model_len`` request needs the
    smallest share of the tightest rank's KV ``memory`` (bytes per block of the rank x blocks per
    request, as vLLM's ``_max_memory_usage_bytes_from_groups`` measures it); on a tie vLLM's
    grouping, then fewer groups. ``partition``: target layers per rank (the drafter's on the last
    rank); ``memory``: each rank's KV bytes. Returns ``layout`` when vLLM's grouping wins and
    ``layout`` is vLLM's, or it has one group."""
    return SplitGrouping(layout, max_model_len).for_split(partition, memory)


def _kept(note: str) -> bool:
    """Whether a note stays on the package's grouping: not stock vLLM's grouping's (nor another
    split's grouping's), which it replaces."""
    return ("drafter's attention layers have their own KV spec" not in note
            and not note.startswith(("vLLM groups the ", "with PP > 1 the dualgpu executor groups ")))


class SplitGrouping:
    """:func:`per_rank_grouping` of ``layout`` for a ``max_model_len`` request, for any split
    (:meth:`for_split`): what does not depend on the split is worked out once."""

    def __init__(self, layout: KVLayout, max_model_len: int):
        self.layout = layout
        self.built: dict[tuple[int, ...], KVLayout] = {}
        self.cuts: dict[tuple[int, ...], list] = {}
        self.stock: KVLayout | None = None
        if len(layout.stock_groups) < 2:
            return  # one group: nothing to choose
        stock = layout
        if layout.grouping != "hybrid":
            stock = replace(layout, groups=list(layout.stock_groups), grouping="hybrid", notes=list(layout.notes),
                            raw_slots=list(layout.raw_slots))
            stock._index()
        self.stock = stock
        self.stock_per_request = stock.blocks_per_request(max_model_len)
        self.buckets = spec_buckets(layout.slots)
        self.mamba_blocks = mamba_blocks(layout.mamba_cache_mode, layout.num_speculative_tokens)
        self.pages, self.per_group, self.prefix, self.drafter = [], [], [], []
        for members in self.buckets:
            s0 = layout.slots[members[0]]
            self.pages.append(s0.page_bytes)  # one spec, one page
            [g] = strided_groups(layout.slots, [members[:1]], [1], self.mamba_blocks)
            self.per_group.append(g.blocks_per_request(max_model_len))
            on = [0] * (layout.num_layers + 1)  # the bucket's target layers before each index
            for m in members:
                i = layout.slots[m].layer_index
                if i is not None:
                    on[i + 1] += 1
            for i in range(layout.num_layers):
                on[i + 1] += on[i]
            self.prefix.append(on)
            self.drafter.append(sum(1 for m in members if layout.slots[m].layer_index is None))
        # vLLM's grouping cuts the same buckets alike (planner/kv.py _hybrid_groups)
        self.stock_counts = tuple(sum(1 for g in stock.groups if g.members[0] in members) for members in self.buckets)
        cut = strided_groups(layout.slots, self.buckets, self.stock_counts, self.mamba_blocks)
        assert [g.members for g in cut] == [g.members for g in stock.groups]

    def for_split(self, partition, memory) -> KVLayout:
        """The grouping for target layers ``partition`` per rank (the drafter's on the last) and
        ``memory``, each rank's KV bytes: the stock layout when vLLM's own grouping wins."""
        if self.stock is None:
            return self.layout
        counts = []  # each bucket's layers on each rank
        for pre, drafter in zip(self.prefix, self.drafter):
            on, start = [], 0
            for n in partition:
                on.append(pre[start + n] - pre[start])
                start += n
            on[-1] += drafter
            counts.append(on)
        mem = [max(m, 1) for m in memory]
        best = (round(self._cost(counts, mem, self.stock_counts, self.stock_per_request), 12), 0,
                len(self.stock.groups))
        best_counts = None
        for n, per_request in self._cuts(tuple(max(on) for on in counts)):
            key = (round(self._cost(counts, mem, n, per_request), 12), 1, sum(n))
            if key < best:  # the first of equals, as min() over the caps in order
                best, best_counts = key, n
        return self.stock if best_counts is None else self._layout(best_counts)

    def _cost(self, counts, mem, n: tuple[int, ...], per_request: int) -> float:
        """The share of the tightest rank's KV memory one request needs when each bucket is cut
        into ``n`` groups (``counts``: each bucket's layers per rank, ``mem``: their KV bytes)."""
        worst = 0.0
        for r, m in enumerate(mem):
            bpb = 0
            for on, k, page in zip(counts, n, self.pages):
                c = on[r]
                if c and -(-c // k) * page > bpb:
                    bpb = -(-c // k) * page
            if bpb and bpb * per_request / m > worst:
                worst = bpb * per_request / m
        return worst

    def _cuts(self, tops: tuple[int, ...]) -> list[tuple[tuple[int, ...], int]]:
        """The capped groupings (group counts per bucket, blocks a request takes) in cap order,
        none with more groups than vLLM's, for buckets whose most layers on one rank are
        ``tops``: a bucket is cut for a cap into cdiv(top, cap) groups, never more than its layers."""
        if tops not in self.cuts:
            cuts, previous = [], None
            for cap in range(1, max(tops) + 1):
                n = tuple(min(max(1, cdiv(top, cap)), len(members)) for top, members in zip(tops, self.buckets))
                if n != previous and sum(n) <= len(self.stock.groups):  # the caps that cut alike come in a row
                    cuts.append((n, sum(k * q for k, q in zip(n, self.per_group))))
                previous = n
            self.cuts[tops] = cuts
        return self.cuts[tops]

    def _layout(self, counts: tuple[int, ...]) -> KVLayout:
        if counts not in self.built:
            base = self.layout
            groups = strided_groups(base.slots, self.buckets, counts, self.mamba_blocks)
            sizes = "/".join(sorted({str(len(g.members)) for g in groups}, key=int))
            notes = [n for n in base.notes if _kept(n)]
            notes.append(f"with PP > 1 the dualgpu executor groups the {len(base.slots)} KV layers into "
                         f"{len(groups)} groups of {sizes} layers instead of vLLM's {len(self.stock.groups)} "
                         "(its KV patches: fewer layers of one group on the tightest rank)")
            layout = replace(base, groups=groups, grouping="dualgpu", notes=notes, raw_slots=list(base.raw_slots))
            layout._index()
            self.built[counts] = layout
        return self.built[counts]

