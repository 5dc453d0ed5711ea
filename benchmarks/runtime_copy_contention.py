"""Does a copy stream at full bandwidth slow the host? A probe, on CUDA.

    python3 benchmarks/runtime_copy_contention.py MODEL_DIR   # a config folder, e.g. Qwen3-30B-A3B's

At B=1 an offloaded decode step copies about as many bytes as a step lasts at the pinned bandwidth,
while the host drives the model; its bound (the all-resident model) copies nothing. This builds the
model as `duoserve-run bench --config-only --layers 16 --routing random` does and times the
all-resident model's 32-token B=1 decode, and a pure-Python loop, three rounds of: no copies; another
process copying a pinned 1 GiB buffer to the GPU back to back (what the engine's copies do to host
memory); the same device to host. The copier is another process so that this one's synchronisations
do not wait for its copies. Each line: TPOT, host ms per layer inside and between experts calls, the
host's pace (us per small torch op, and ns per Python loop step), and the copier's GB/s.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import torch
from runtime_profile import setup, split_run

from duoserve.runtime.bench import BenchSettings

COPIER = """
import sys, time, torch
direction, host = sys.argv[1], torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
device = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
src, dst = (host, device) if direction == "h2d" else (device, host)
print("ready", flush=True)
start, copies = time.perf_counter(), 0
try:
    while True:
        for _ in range(4):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        copies += 4
        print(f"{copies * 2**30 / (time.perf_counter() - start) / 1e9:.1f}", flush=True)
except KeyboardInterrupt:
    pass
"""


def python_ns(steps: int = 1_000_000) -> float:
    """Nanoseconds per step of a plain Python loop (dict stores): the interpreter's pace, no torch."""
    table, start = {}, time.perf_counter()
    for i in range(steps):
        table[i & 1023] = i
    return (time.perf_counter() - start) / steps * 1e9


def main() -> None:
    s = BenchSettings(model=sys.argv[1], config_only=True, layers=16, routing="random", new_tokens=32)
    model, stores, ids = setup(s, 1, torch.device("cuda"))
    split_run(model, stores, s, ids, "all-resident")  # warm the process
    for _ in range(3):
        for direction in (None, "h2d", "d2h"):
            copier = None
            if direction:
                copier = subprocess.Popen([sys.executable, "-c", COPIER, direction], stdout=subprocess.PIPE, text=True)
                assert copier.stdout.readline().strip() == "ready"
                time.sleep(1.0)  # copying by now
            try:
                loop = python_ns()
                run, inside, between = split_run(model, stores, s, ids, "all-resident")
            finally:
                rate = "-"
                if copier:
                    copier.send_signal(signal.SIGINT)
                    lines = copier.communicate()[0].split()
                    rate = lines[-1] if lines else "?"
            print(f"{direction or 'no copies'}: TPOT {run['tpot_ms']:.2f} ms; per layer, ms: inside experts "
                  f"{inside:.3f}, between {between:.3f}; host {run['host_op_us']:.1f} us/op, Python loop {loop:.1f} "
                  f"ns/step; copier {rate} GB/s", flush=True)


if __name__ == "__main__":
    main()
