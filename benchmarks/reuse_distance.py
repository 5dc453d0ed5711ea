"""Why a cache of 10% of the experts gains little on real routing: reuse distances of (layer, expert) accesses.

    python benchmarks/reuse_distance.py --trace embedded=out/traces \\
        --trace substrate=benchmarks/data/substrate/traces --trace flame=DIR \\
        --plot benchmarks/results/reuse_distance.png --out benchmarks/results/reuse_distance_cpu.json

The first ``--rows`` token rows of each trace, in file order (what ``--routing TRACE`` replays), as a stream of
(layer, expert) accesses, layer by layer within a token. An access's stack distance is the number of distinct
other experts touched since that expert's previous access: an LRU cache of C experts hits exactly the accesses
of distance < C (Mattson et al., 1970). Beside that curve, the share of accesses that the C most popular
experts take (pinning them and nothing else), and at a few sizes the hit rate of Belady's optimal cache, which
knows the whole stream and evicts the expert used farthest ahead: no policy, pinned, predicted or other, that
holds every expert it computes can hit more, so 1 - its misses / LRU's misses bounds the bytes any cache of C
saves against LRU; and, as an online policy that uses what a stats file knows, a cache that evicts its least
popular expert (pinning's choice, made anew at every miss, every slot in play). All are plotted against C as a
share of the L x E experts, with L x k (the experts one token touches, the least distance a token-to-token reuse
can have) marked.
"""

from __future__ import annotations

import heapq
from pathlib import Path

import numpy as np

from duoserve.bench.results import parser, write_result
from duoserve.trace.format import open_trace

OPTIMAL_AT = (0.05, 0.1, 0.25, 0.5)  # cache shares at which the optimal cache is simulated (one pass each)


def accesses(trace: Path, rows: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Flat (layer * E + expert) keys of the first ``rows`` token rows, in replay order; and (L, E, k)."""
    t = open_trace(trace)
    L, E, k = t.meta.num_layers, t.meta.num_experts, t.meta.top_k
    ids = np.concatenate(list(t.iter_experts(None)))[:rows]  # N x L x k
    keys = ids + (np.arange(L) * E)[None, :, None]  # N x L x k
    return keys.reshape(-1), (L, E, k)


def stack_distances(keys: np.ndarray) -> np.ndarray:
    """Per access, the distinct keys touched since the same key's last access (-1 for a first access): a Fenwick
    tree over access times that marks each key's latest access only."""
    n = len(keys)
    tree = np.zeros(n + 1, dtype=np.int64)

    def add(i: int, v: int) -> None:
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(i: int) -> int:  # marks at times < i
        total = 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    last: dict[int, int] = {}
    out = np.full(n, -1, dtype=np.int64)
    marked = 0
    for t, key in enumerate(keys.tolist()):
        prev = last.get(key)
        if prev is not None:
            out[t] = marked - prefix(prev + 1)  # latest marks after prev
            add(prev, -1)
            marked -= 1
        add(t, 1)
        marked += 1
        last[key] = t
    return out


def optimal_hits(keys: np.ndarray, capacity: int) -> float:
    """Hit rate of Belady's MIN on ``keys`` with ``capacity`` slots: a miss is always cached, evicting the cached key
    whose next access is farthest ahead (a max-heap of next accesses, entries of keys since re-used skipped)."""
    n = len(keys)
    next_use = np.full(n, n, dtype=np.int64)  # per access, when its key comes next (n: never)
    seen: dict[int, int] = {}
    for t in range(n - 1, -1, -1):
        key = int(keys[t])
        next_use[t] = seen.get(key, n)
        seen[key] = t
    cached: dict[int, int] = {}  # key -> its next access
    heap: list[tuple[int, int]] = []  # (-next access, key)
    hits = 0
    for t, key in enumerate(keys.tolist()):
        if key in cached:
            hits += 1
        elif len(cached) >= capacity:
            while True:
                far, victim = heapq.heappop(heap)
                if cached.get(victim) == -far:
                    del cached[victim]
                    break
        cached[key] = int(next_use[t])
        heapq.heappush(heap, (-cached[key], key))
    return hits / n


def least_popular_hits(keys: np.ndarray, capacity: int, counts: np.ndarray) -> float:
    """Hit rate of a cache of ``capacity`` that caches every miss and evicts the cached key of the fewest
    ``counts`` (ties: the key's id)."""
    cached: set[int] = set()
    heap: list[tuple[int, int]] = []  # (count, key) of the cached keys
    hits = 0
    for key in keys.tolist():
        if key in cached:
            hits += 1
            continue
        if len(cached) >= capacity:
            cached.discard(heapq.heappop(heap)[1])
        cached.add(key)
        heapq.heappush(heap, (int(counts[key]), key))
    return hits / len(keys)


def main() -> None:
    ap = parser(__doc__, geometry=None)
    ap.add_argument("--trace", action="append", default=[], help="NAME=DIR, repeatable")
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    shares = np.linspace(0.01, 1.0, 100)
    results = {}
    for spec in args.trace:
        name, path = spec.split("=", 1)
        keys, (L, E, k) = accesses(Path(path), args.rows)
        dist = stack_distances(keys)
        slots = np.maximum(1, (shares * L * E).astype(int))
        def lru_hits(c: int) -> float:
            return np.count_nonzero((dist >= 0) & (dist < c)) / len(dist)

        lru = [lru_hits(c) for c in slots]
        by_key = np.bincount(keys, minlength=L * E)  # accesses of each (layer, expert)
        counts = np.sort(by_key)[::-1]
        pinned = np.cumsum(counts)[slots - 1] / len(keys)
        reuse = dist[dist >= 0]
        sizes = {share: max(1, int(share * L * E)) for share in OPTIMAL_AT}
        optimal = {share: optimal_hits(keys, c) for share, c in sizes.items()}
        popular = {share: least_popular_hits(keys, c, by_key) for share, c in sizes.items()}
        results[name] = {"geometry": [L, E, k], "accesses": len(keys), "token_footprint": L * k,
                         "reuse_distance_quantiles": {q: float(np.quantile(reuse, q)) for q in (0.1, 0.25, 0.5, 0.75)},
                         "share_of_reuses_within_10pct": float(np.mean(reuse < 0.1 * L * E)),
                         "curve": {"cache_share": shares.tolist(), "lru_hit": lru, "pin_top_hit": pinned.tolist()},
                         "optimal_hit": {str(share): hit for share, hit in optimal.items()},
                         "evict_least_popular_hit": {str(share): hit for share, hit in popular.items()},
                         "bytes_saved_vs_lru_at_most": {str(share): 1 - (1 - hit) / (1 - lru_hits(sizes[share]))
                                                        for share, hit in optimal.items()}}
        print(f"{name}: L x E = {L * E}, one token touches {L * k}; reuse distance quartiles "
              f"{[round(v) for v in results[name]['reuse_distance_quantiles'].values()]}; at 10% of the experts "
              f"LRU hits {lru[9]:.3f}, the most popular 10% take {pinned[9]:.3f} of accesses, the optimal cache hits "
              f"{optimal[0.1]:.3f}, one evicting its least popular {popular[0.1]:.3f}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.6), squeeze=False)
        for ax, (name, r) in zip(axes[0], results.items()):
            L, E, k = r["geometry"]
            c = r["curve"]
            ax.plot(np.array(c["cache_share"]) * 100, c["lru_hit"], label="LRU (stack distance)")
            ax.plot(np.array(c["cache_share"]) * 100, c["pin_top_hit"], label="pin the most popular")
            ax.plot([100 * float(x) for x in r["optimal_hit"]], list(r["optimal_hit"].values()), "o--",
                    label="optimal (Belady), the ceiling")
            ax.plot([100 * float(x) for x in r["evict_least_popular_hit"]], list(r["evict_least_popular_hit"].values()),
                    "s:", label="evict the least popular")
            ax.axvline(100 * L * k / (L * E), color="grey", ls=":", label="one token's experts (L x k)")
            ax.axvline(10, color="red", ls="--", lw=0.8, label="10% budget")
            ax.set(title=f"{name} ({L} x {E}, top-{k})", xlabel="cache, % of all experts", ylabel="hit rate",
                   ylim=(0, 1))
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
    write_result(args.out, {"benchmark": "reuse_distance", "rows": args.rows, "traces": results})


if __name__ == "__main__":
    main()
