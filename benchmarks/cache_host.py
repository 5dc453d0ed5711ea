"""The host's cost of the expert cache's books as the cache grows: picking victims and building a call's pair rows.

    python benchmarks/cache_host.py [--out benchmarks/results/cache_host_cpu.json]

A decode step is short of host time, and ``--gpu-expert-budget`` reaches thousands of slots (25% of
Qwen3-30B-A3B's 6,144 experts is 1,536), so what the cache does per call must not grow with its size. For
S = 16 .. 4096 slots of a cache kept full, with the key space of Qwen3-30B-A3B (48 x 128 experts): the
microseconds to fetch k = 8 new experts (victims, books, the CPU's copies of 32-byte rows) and release them,
and to build one B=1 decode call's pair rows (``Routing.rows``) with its experts spread over the slots.
"""

from __future__ import annotations

import timeit

import numpy as np
import torch

from duoserve.bench.drivers import RandomRouting
from duoserve.bench.results import parser, write_result
from duoserve.runtime.cache import ExpertCache
from duoserve.runtime.experts import Routing
from duoserve.runtime.store import HostExperts
from duoserve.runtime.streams import Streams

L, E, K = 48, 128, 8


def fetch_us(slots: int, rounds: int = 300) -> float:
    store = HostExperts.pack({"w": torch.zeros(E, 1, 8)}, pin=False)
    cache = ExpertCache(store.layout, slots, Streams(torch.device("cpu")))
    rng = np.random.default_rng(0)

    def step() -> None:
        layer = int(rng.integers(L))
        new = [int(e) for e in rng.choice(E, K, replace=False) if (layer, int(e)) not in cache.slot_of]
        cache.release(cache.fetch(layer, new, store, "decode", keep=set()))

    for _ in range(3 * slots // K + 10):  # full, and past its first turnover
        step()
    return min(timeit.repeat(step, number=rounds, repeat=3)) / rounds * 1e6


def rows_us(slots: int, rounds: int = 500) -> float:
    routing = Routing(RandomRouting(1, E, K, seed=1).begin(1)[0], E)  # B=1: k pairs
    spread = np.linspace(0, slots - 1, len(routing.needed)).astype(int)
    where = {e: int(s) for e, s in zip(routing.needed, spread)}
    return min(timeit.repeat(lambda: routing.rows(where, slots), number=rounds, repeat=3)) / rounds * 1e6


def main() -> None:
    ap = parser(__doc__, geometry=None)
    ap.add_argument("--slots", default="16,128,512,1024,1536,4096")
    args = ap.parse_args()
    rows = []
    for slots in (int(s) for s in args.slots.split(",")):
        row = {"slots": slots, "fetch_release_us": fetch_us(slots), "rows_us": rows_us(slots)}
        print(f"S={slots:5d}: fetch + release of {K} experts {row['fetch_release_us']:6.1f} us, "
              f"pair rows of a B=1 call {row['rows_us']:5.1f} us", flush=True)
        rows.append(row)
    write_result(args.out, {"benchmark": "cache_host", "key_space": [L, E, K], "results": rows})


if __name__ == "__main__":
    main()
