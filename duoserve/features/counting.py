"""Counting expert pairs of consecutive layers, exactly, on the CPU or a CUDA device.

Shape legend: N tokens, L MoE layers, E experts, k top-k.

A token adds k*k pair increments per layer pair, (L-1)*k*k a row (3,008 at L=48, k=8), so the
count is a histogram of random keys, bound by memory latency, not arithmetic: a dense one-hot GEMM
does E*E/(k*k) times the work (256x at E=128, k=8) and a sparse product pays per-element overhead.
- CPU: one compiled loop (numba) per layer pair into a uint16 histogram of E*E bins that stays in
  L1 (32 KB at E=128), flushed into the int64 totals every 65,535 // (k*k) tokens, so it cannot
  overflow even where a token repeats an id (a token adds at most k*k to one bin).
  Without numba, the same counts from numpy's bincount, several times slower.
- CUDA: the dense form pays there: per layer pair, the chunk's multi-hot matrices multiplied on the
  tensor cores, (E x n) @ (n x E) in bf16 with fp32 sums (exact integers), 4x the rate of
  scatter-adding the keys, whose atomics bound them near 17M rows/s on an H200. Batches arrive
  through pinned staging buffers, so the copy and the count of one batch overlap the host's read
  of the next (no call in the loop waits for the device).
Popularity needs no count of its own: every token puts exactly k ids at each layer, so a row of the
affinity counts sums to k times the expert's selections (exact even with repeated ids).
"""

from __future__ import annotations

import numpy as np
import torch

from duoserve.trace.info import expert_counts

try:
    import numba
except ImportError:  # an install without numba (e.g. --no-deps): numpy's bincount, several times slower
    numba = None

BACKENDS = ("auto", "numba", "numpy")


def _pair_loop(ids: np.ndarray, num_experts: int, out: np.ndarray) -> None:
    """Add the consecutive-layer pair counts of ``ids`` (N x L x k uint16, all < E) into ``out``
    ((L-1) x E*E int64). Unsigned indices: numba then needs no negative-index wrap-around (1.6x faster)."""
    N, L, k = ids.shape
    E = np.uint64(num_experts)
    bins = np.zeros(num_experts * num_experts, np.uint16)
    one = np.uint16(1)
    flush = max(65_535 // (k * k), 1)  # tokens per flush: no bin can pass uint16's range in between
    for l in range(L - 1):
        for start in range(0, N, flush):
            for t in range(start, min(N, start + flush)):
                for p in range(k):
                    row = np.uint64(ids[t, l, p]) * E
                    for q in range(k):
                        bins[row + np.uint64(ids[t, l + 1, q])] += one
            for b in range(num_experts * num_experts):
                out[l, b] += bins[b]
                bins[b] = 0


_compiled = numba.njit(nogil=True, cache=True)(_pair_loop) if numba is not None else None


def _pairs_numpy(ids: np.ndarray, num_experts: int, out: np.ndarray) -> None:
    E = num_experts
    by_layer = np.ascontiguousarray(ids.transpose(1, 0, 2), dtype=np.int32)  # L x N x k, one block per layer
    for l in range(len(by_layer) - 1):  # per layer pair, so the E*E bins stay in cache
        keys = by_layer[l][:, :, None] * E + by_layer[l + 1][:, None, :]  # N x k x k: flat (i, j)
        out[l] += np.bincount(keys.ravel(), minlength=E * E)


def _unsigned(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """``ids`` as a C-contiguous uint16 array (a view where they are int16), refused if any is outside 0..E-1:
    the compiled loop indexes with them unchecked."""
    ids = np.ascontiguousarray(ids)
    if ids.dtype == np.int16:  # the trace's type: one pass, as a negative id reads as 32768 or more unsigned
        unsigned = ids.view(np.uint16)
        bad = int(unsigned.max()) >= num_experts
    else:
        bad = int(ids.min()) < 0 or int(ids.max()) >= num_experts
        unsigned = ids.astype(np.uint16) if not bad else ids
    if bad:
        wrong = ids[(ids < 0) | (ids >= num_experts)].flat[0]
        raise ValueError(f"expert id {wrong} is outside 0..{num_experts - 1}")
    return unsigned


def cpu_backend(backend: str = "auto") -> str:
    """The CPU counting backend to use: 'numba' where it is installed (or asked for), else 'numpy'."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown counting backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if backend == "numba" and numba is None:
        raise ValueError("the numba counting backend needs numba (pip install numba)")
    if backend == "auto":
        return "numba" if numba is not None else "numpy"
    return backend


def popularity_from_pairs(pairs: np.ndarray, top_k: int) -> np.ndarray:
    """L x E selection counts from (L-1) x E x E pair counts (L >= 2): rows sum to k per selection at l,
    columns to k per selection at l+1."""
    first = pairs.sum(2)  # (L-1) x E: layers 0..L-2
    last = pairs[-1].sum(0, keepdims=True)  # 1 x E: layer L-1
    return np.concatenate([first, last]) // top_k


class RoutingCounter:
    """Accumulates popularity and affinity counts of N x L x k id batches on ``device`` (exact int64)."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, device: str | torch.device = "cpu",
                 backend: str = "auto", chunk_rows: int = 16_384):
        self.L, self.E, self.k = num_layers, num_experts, top_k
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.tokens = 0
        self._single = np.zeros((1, num_experts), np.int64)  # L = 1: no pairs to derive popularity from
        if self.device.type == "cuda":
            self._cuda = _CudaPairs(num_layers, num_experts, top_k, self.device, chunk_rows)
        else:
            self._backend = cpu_backend(backend)
            self._pairs = np.zeros((max(num_layers - 1, 0), num_experts * num_experts), np.int64)

    def add(self, ids: np.ndarray | torch.Tensor) -> None:
        """Count one batch: N x L x k integer ids in 0..E-1, a host array, or a tensor already on the counter's
        CUDA device (counted where it is)."""
        if isinstance(ids, torch.Tensor):
            if ids.device.type == "cpu":
                ids = ids.numpy()
            elif ids.device != self.device:
                raise ValueError(f"ids on {ids.device}, counter on {self.device}: move one of them")
        if ids.ndim != 3 or tuple(ids.shape[1:]) != (self.L, self.k):
            raise ValueError(f"expected N x {self.L} x {self.k} expert ids, got shape {ids.shape}")
        if len(ids) == 0:
            return
        if not isinstance(ids, torch.Tensor):
            ids = _unsigned(ids, self.E)
        self.tokens += len(ids)
        if self.L == 1:
            self._single += expert_counts(ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids, self.E)
        elif self.device.type == "cuda":
            self._cuda.add(ids)
        elif self._backend == "numba":
            _compiled(ids, self.E, self._pairs)
        else:
            _pairs_numpy(ids, self.E, self._pairs)

    def counts(self) -> tuple[np.ndarray, np.ndarray]:
        """Popularity (L x E) and affinity ((L-1) x E x E) int64 counts so far."""
        if self.L == 1:
            return self._single.copy(), np.zeros((0, self.E, self.E), np.int64)
        pairs = self._cuda.result() if self.device.type == "cuda" else self._pairs.copy()
        pairs = pairs.reshape(self.L - 1, self.E, self.E)
        return popularity_from_pairs(pairs, self.k), pairs


class _CudaPairs:
    """Pair counts on a CUDA device: pinned staging (two buffers in turn), async copy, one-hot GEMMs."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, device: torch.device, chunk_rows: int):
        L, E, k = num_layers, num_experts, top_k
        if torch.torch_version.TorchVersion(torch.__version__) < "2.8":
            raise ValueError(f"counting on CUDA needs torch >= 2.8 (bmm's out_dtype); this is {torch.__version__}")
        self.L, self.E, self.device = L, E, device
        self.chunk_rows = min(chunk_rows, 2 ** 24 // (k * k))  # fp32 sums of one chunk stay exact integers
        self.pairs = torch.zeros(L - 1, E, E, dtype=torch.int64, device=device)
        self.ones = torch.ones(1, 1, 1, dtype=torch.bfloat16, device=device)
        self.staging: list[torch.Tensor | None] = [None, None]
        self.copied = [torch.cuda.Event(), torch.cuda.Event()]
        self.turn = 0

    def add(self, ids: np.ndarray | torch.Tensor) -> None:
        self.count(ids if isinstance(ids, torch.Tensor) else self.upload(ids))

    def upload(self, ids: np.ndarray) -> torch.Tensor:
        """``ids`` on the device, through the next pinned buffer (copied asynchronously)."""
        i, self.turn = self.turn, 1 - self.turn
        self.copied[i].synchronize()  # this buffer's previous copy has left it
        buf = self.staging[i]
        if buf is None or buf.numel() < ids.size:
            buf = self.staging[i] = torch.empty(ids.size, dtype=torch.int16, pin_memory=True)
        staged = buf[:ids.size].view(ids.shape)  # N x L x k
        np.copyto(staged.numpy(), ids.view(np.int16))  # Arrow's buffers are read-only: copied, never wrapped
        on_device = staged.to(self.device, non_blocking=True)
        self.copied[i].record()
        return on_device

    def count(self, ids: torch.Tensor) -> None:
        """Add the pair counts of device-resident N x L x k ids, a chunk of rows at a time (bounded memory): per
        layer pair, multi-hot (E x n) @ (n x E) in bf16 with fp32 sums, exact below 2^24 a cell."""
        for chunk in ids.split(self.chunk_rows):
            index = chunk.transpose(0, 1).long()  # L x n x k
            hot = torch.zeros(self.L, len(chunk), self.E, dtype=torch.bfloat16, device=self.device)  # L x n x E
            hot.scatter_add_(2, index, self.ones.expand(index.shape))  # counts, so a repeated id counts twice
            self.pairs += torch.bmm(hot[:-1].transpose(1, 2), hot[1:], out_dtype=torch.float32).long()  # (L-1) x E x E

    def result(self) -> np.ndarray:
        return self.pairs.view(self.L - 1, -1).cpu().numpy()  # waits for the queued counts
