"""The device expert cache: S slots of packed experts shared by all layers, keyed by (layer, expert).

Shape legend: S slots, P elements of one packed expert.

Each slot carries two events: ``ready`` (its copy has landed; compute waits on it) and ``free``
(the last compute that read it has run; what writes it waits on it: the copy, or for a quantized store
the dequantization, its copy to staging running ahead), so a slot can be refilled while other slots
compute, with no CPU synchronisation. Experts are fetched in groups: one switch to
the copy stream and one ``ready`` event per group, as the host's time per launch is what a decode
step is short of. Eviction picks, among the slots a call may take, the lowest (wanted, last used):
``wanted`` is the predictor's score for an expert fetched for a layer still to run, and recency
breaks ties, so with no predictor it is plain LRU. Which slot holds which expert is known on the
host only; kernels get slot ids from the engine. A cache of more than ``HEAP_SLOTS`` slots keeps the
ranking in a heap with lazy deletion (an entry per change of a slot's rank, stale ones skipped when
they surface, rebuilt when it has grown to twice the slots), so picking victims costs the host
O(count log S), not a pass over S slots: budgets reach thousands of slots, and a decode step is short
of host time; a smaller one scans its slots, which costs less there (``benchmarks/cache_host.py``).

The cache also keeps the books of copies made ahead of a layer's router (``copy_ahead``): which
experts were wanted for which layer, and, for predicted ones, how many the layer really used
(``settle``, when its router has spoken).

Pinned slots (``pin``: e.g. each layer's most popular experts, ``popular_keys``) are filled once and never
chosen as victims; the other ``open_slots`` are managed as above. Callers size their work by ``room``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from duoserve.runtime.store import ExpertLayout, HostExperts, Rows, staged
from duoserve.runtime.streams import Streams

Key = tuple[int, int]  # (layer, expert)
HEAP_SLOTS = 64  # caches of more slots rank them in a heap


@dataclass
class CacheStats:
    lookups: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    hits: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    copies: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    bytes: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    prefetched: int = 0  # copies made for a layer before its router ran
    prefetch_used: int = 0  # of those, experts the layer really routed to


class ExpertCache:
    """``slots`` packed experts on ``streams.device``; see the module docstring for the rules."""

    def __init__(self, layout: ExpertLayout, slots: int, streams: Streams):
        if slots < 1:
            raise ValueError(f"the expert cache needs at least one slot, got {slots}")
        self.layout, self.streams, self.slots = layout, streams, slots
        self.buffer = torch.zeros(slots, layout.numel, dtype=layout.dtype, device=streams.cache_device)  # S x P
        self.views = layout.views(self.buffer)  # name -> S x shape, what the experts kernels read
        self.rows = Rows(self.buffer)  # what copies write: a slot, or a stretch of them
        self.key: list[Key | None] = [None] * slots
        self.slot_of: dict[Key, int] = {}
        self.ready: list = [None] * slots
        self.free: list = [None] * slots
        # each slot's rank as a victim, lowest first: (wanted, used), where ``used`` is the clock of its last fetch or
        # release and ``wanted`` its score; an empty slot ranks (-1.0, -1), below every held one
        self.used = [-1] * slots
        self.clock = 0  # advances per fetch group and release, so groups of one layer call are ordered too
        self.wanted = [-1.0] * slots
        self._version = [0] * slots  # bumped at each change of a slot's rank; heap entries of older ones are stale
        # (wanted, used, slot, version), empty slots first; None: a small cache, scanned instead
        self._heap = [(-1.0, -1, s, 0) for s in range(slots)] if slots > HEAP_SLOTS else None
        self.pinned: set[Key] = set()  # keys whose slots are never refilled
        self._dequantizing = False  # the last fetch's store finishes its copies on the dequant stream
        self._dequantized = None  # then: the event its last dequantization pass recorded
        self.scratch: dict = {}  # device staging of quantized stores, shared by all layers (``quant.py``)
        self.stats = CacheStats()
        self._wanted_for: dict[int, set[int]] = {}  # layer -> experts given a score for it before its router ran
        self._predicted_for: dict[int, set[int]] = {}  # layer -> experts copied ahead for it on a prediction

    @property
    def open_slots(self) -> int:
        """Slots the cache manages (all but the pinned ones)."""
        return self.slots - len(self.pinned)

    def room(self, busy: set[Key] | frozenset = frozenset()) -> int:
        """Open slots left for new experts while the ``busy`` keys stay (pinned ones take none of them)."""
        if not self.pinned:  # the decode step's case: no set built
            return self.slots - len(busy)
        return self.open_slots - len(busy - self.pinned)

    def fits(self, layer: int, experts: list[int]) -> bool:
        """Whether ``experts`` of ``layer`` can all be resident at once (the pinned ones are, without a slot)."""
        if not self.pinned:  # the decode step's case: no set built
            return len(experts) <= self.slots
        return sum((layer, e) not in self.pinned for e in experts) <= self.open_slots

    def pin(self, keys: list[Key], stores: list[HostExperts]) -> None:
        """Fill a slot with each of ``keys`` (layer, expert), on the copy stream, and keep them for the cache's life;
        their copies count in no phase's bytes."""
        if len(keys) > self.slots - 1:
            raise ValueError(f"cannot pin {len(keys)} experts in a cache of {self.slots} slots; leave at least one")
        by_layer: dict[int, list[int]] = {}
        for layer, e in keys:
            by_layer.setdefault(layer, []).append(e)
        for layer, experts in by_layer.items():
            self.fetch(layer, experts, stores[layer], None, self.pinned)
            self.pinned.update((layer, e) for e in experts)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def lookup(self, key: Key) -> int | None:
        return self.slot_of.get(key)

    def _touch(self, slots: Iterable[int]) -> None:
        """These slots' keys, scores or recency changed: queue their new ranks (empty slots rank lowest). One call
        per batch of slots: a small cache keeps no ranking, and a decode step changes a few dozen slots a layer."""
        if self._heap is None:
            return
        for s in slots:
            self._version[s] += 1
            if self.key[s] in self.pinned:
                continue  # never a victim: out of the ranking
            heapq.heappush(self._heap, (self.wanted[s], self.used[s], s, self._version[s]))
        if len(self._heap) > 2 * self.slots + 64:  # mostly stale: rebuild from the live entries
            self._heap = [entry for entry in self._heap if entry[3] == self._version[entry[2]]]
            heapq.heapify(self._heap)

    def victims(self, count: int, keep: set[Key]) -> list[int]:
        """The ``count`` slots to refill: empty ones first, then the lowest (wanted, last used), ties by slot, never
        one holding a key in ``keep`` or a pinned one; the cache's state is unchanged until the caller refills them.
        In that order, except where they are all the slots it may take (a small cache's decode prefetch, mostly):
        then in slot order, unranked."""
        if self._heap is None:
            skip = keep | self.pinned if self.pinned else keep
            wanted, used = self.wanted, self.used
            # (wanted, used, slot) of each slot it may take: tuples compare in C, where a sort key is a call a slot
            ranked = [(wanted[s], used[s], s) for s, key in enumerate(self.key) if key not in skip]
            if len(ranked) < count:
                raise self._full(count, keep)
            if len(ranked) > count:  # else every slot it may take: no ranking
                ranked.sort()
            return [rank[2] for rank in ranked[:count]]
        chosen, held = [], []
        while len(chosen) < count and self._heap:
            entry = heapq.heappop(self._heap)
            s = entry[2]
            if entry[3] != self._version[s] or self.key[s] in self.pinned:
                continue  # stale, or pinned since it was ranked
            (held if self.key[s] in keep else chosen).append(entry)
        for entry in held + chosen:  # chosen ones go stale once the caller refills them
            heapq.heappush(self._heap, entry)
        if len(chosen) < count:
            raise self._full(count, keep)
        return [entry[2] for entry in chosen]

    def _full(self, count: int, keep: set[Key]) -> RuntimeError:
        return RuntimeError(f"expert cache of {self.slots} slots cannot take {count} experts while {len(keep)} must "
                            "stay; raise the GPU expert budget")

    def fetch(self, layer: int, experts: list[int], store: HostExperts, phase: str | None, keep: set[Key],
              stream=None, wanted: list[float] | None = None, seal: bool = True) -> list[int]:
        """Copy ``experts`` of ``layer`` (none of them cached) from ``store`` into victim slots (never one holding a
        key in ``keep``) on ``stream`` (default: the copy stream); their slots. ``wanted``: each expert's score.
        ``phase``: whose copies and bytes they count as (None: nobody's). ``seal=False``: the caller queues more
        work on ``stream`` first, then calls ``seal``."""
        stream = stream or self.streams.copy
        slots = self.victims(len(experts), keep)
        self.clock += 1
        key, slot_of, used, scores = self.key, self.slot_of, self.used, self.wanted
        # slots freed by one compute share its event: wait once for each last reader. A store that stages its copies
        # writes the slots on the dequant stream: only that waits, and its copies to staging run ahead of the compute
        self._dequantizing = staged(store, self.streams)
        writer = self.streams.dequant if self._dequantizing else stream
        for event in dict.fromkeys(map(self.free.__getitem__, slots)):
            self.streams.wait(writer, event)
        for e, s, score in zip(experts, slots, wanted or [0.0] * len(slots)):
            if key[s] is not None:
                del slot_of[key[s]]
            key[s] = new = (layer, e)
            slot_of[new] = s
            used[s], scores[s] = self.clock, score
        self._touch(slots)
        self._dequantized = store.copy_group(experts, slots, self.rows, self.streams, stream, self.scratch)
        if phase is not None:
            self.stats.copies[phase] += len(slots)
            self.stats.bytes[phase] += len(slots) * store.row_bytes
        if seal:
            self.seal(slots, stream, more=False)
        return slots

    def stage(self, experts: list[int], store: HostExperts, stream=None) -> None:
        """Copy the first of ``experts`` (none of them cached) to ``store``'s staging on ``stream`` (default: the copy
        stream) before any slot is chosen for them; only for a store that stages its copies (``staged``: a
        quantized one), which then only dequantizes them when the next ``fetch`` of them comes.
        Bytes and copies count at that fetch."""
        store.stage(experts, self.rows, self.streams, stream or self.streams.copy, self.scratch)

    def seal(self, slots: list[int], stream=None, more: bool = True) -> None:
        """Mark ``slots`` ready once the work queued so far on ``stream`` (their copies, and ``more`` the caller
        queued after them) has run, and the dequantization of what the last fetch copied, if its store is quantized
        (which waited for its copies already: with nothing more, only its end is marked)."""
        if self._dequantizing and not more:
            ready = self._dequantized  # recorded by the last pass: a decode step is short of host time
        elif self._dequantizing:
            self.streams.wait(self.streams.dequant, self.streams.record(stream or self.streams.copy))
            ready = self.streams.record(self.streams.dequant)
        else:
            ready = self.streams.record(stream or self.streams.copy)
        self._dequantizing = False
        for s in slots:
            self.ready[s] = ready

    def release(self, slots: list[int]) -> None:
        """Mark ``slots`` as read by the compute queued so far (their next copy waits for it)."""
        event = self.streams.record()
        self.clock += 1
        clock, free, used, wanted = self.clock, self.free, self.used, self.wanted
        for s in slots:
            free[s], used[s], wanted[s] = event, clock, 0.0
        self._touch(slots)

    def forget(self) -> None:
        """Drop every key but the pinned ones (the slots' contents stay until refilled)."""
        self.slot_of = {key: s for key, s in self.slot_of.items() if key in self.pinned}
        dropped = [s for s, key in enumerate(self.key) if key is not None and key not in self.pinned]
        for s in dropped:
            self.key[s], self.wanted[s], self.used[s] = None, -1.0, -1
        self._touch(dropped)

    def resident(self, layer: int, needed: list[int], phase: str) -> dict[int, int]:
        """The cached experts among ``needed`` of ``layer`` (expert -> slot), counted per phase. The layer's router
        has spoken: scores given to its experts ahead of time are moot, and its predicted copies are settled."""
        slot_of, stats = self.slot_of, self.stats
        if scored := self._wanted_for.pop(layer, None):
            moot = [s for e in scored if (s := slot_of.get((layer, e))) is not None]
            for s in moot:
                self.wanted[s] = 0.0
            self._touch(moot)
        hits = {e: s for e in needed if (s := slot_of.get((layer, e))) is not None}
        stats.lookups[phase] += len(needed)
        stats.hits[phase] += len(hits)
        if predicted := self._predicted_for.pop(layer, None):
            stats.prefetch_used += len(predicted.intersection(hits))
        return hits

    def copy_ahead(self, layer: int, ranked: list[tuple[int, float]], store: HostExperts, phase: str,
                   predicted: bool = True, busy: frozenset | set = frozenset()) -> None:
        """Copy the best-ranked (expert, score) pairs of ``layer`` before its router runs, as many as the cache holds
        besides the ``busy`` keys (which stay), on the copy stream; cached ones only get their score raised.
        ``predicted``: counted in the prefetch statistics (the prefill look-ahead is not a prediction)."""
        ranked = ranked[:self.room(busy)]
        keys = [(layer, e) for e, _ in ranked]
        self._wanted_for.setdefault(layer, set()).update([e for e, _ in ranked])
        slot_of, wanted = self.slot_of, self.wanted
        experts, scores, raised = [], [], []
        for key, (e, score) in zip(keys, ranked):
            if (s := slot_of.get(key)) is None:
                experts.append(e)
                scores.append(score)
            elif score > wanted[s]:
                wanted[s] = score
                raised.append(s)
        self._touch(raised)
        if experts:
            self.fetch(layer, experts, store, phase, busy.union(keys), wanted=scores)
            if predicted:
                self.stats.prefetched += len(experts)
                self._predicted_for.setdefault(layer, set()).update(experts)

    def wait_ready(self, slots) -> None:
        """Make the compute stream wait until ``slots``' copies have landed (a group's slots share one event)."""
        for event in dict.fromkeys(map(self.ready.__getitem__, slots)):
            self.streams.wait(self.streams.compute, event)


def popular_keys(popularity: np.ndarray) -> list[Key]:
    """Every (layer, expert), most often routed to first: the order to pin them in. ``popularity``: L x E, each
    layer's share of its tokens' selections (``duoserve-train stats``), so layers compare on one scale."""
    L, E = popularity.shape
    order = np.argsort(-popularity, axis=None, kind="stable")  # L*E flat positions, most popular first
    return [(int(i // E), int(i % E)) for i in order]
