"""Tracing overhead: traced vs untraced greedy generate, same model, inputs and run.

    python benchmarks/trace_overhead.py                                   # embedded model, CPU
    python benchmarks/trace_overhead.py --shape qwen3-30b-a3b --device cuda --dtype bfloat16

The traced side includes everything a trace costs except the Parquet write: the hooks, the
next-gate routers (look-ahead 1), moving records to the CPU and assembling rows. Random weights
are fine for timing. Prints a table and writes JSON (--out). Targets: <= 1.05x on a GPU, 1.15x on CPU.
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

from duoserve.bench.results import parser, write_result
from duoserve.bench.shapes import shape_config
from duoserve.discovery import find_moe_layers, moe_geometry
from duoserve.loading import load_model
from duoserve.trace.collect import rows_from_records
from duoserve.trace.hooks import RoutingRecorder


def build(args):
    if args.shape is None:
        model, _ = load_model(args.model, args.device, args.dtype)
        return model
    from transformers import AutoModelForCausalLM

    dtype = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "float32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(shape_config(args.shape, args.layers), dtype=dtype)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def main() -> None:
    ap = parser(__doc__, None)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--shape", default=None, help="random-weight model of a real shape (duoserve.bench.shapes)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape has")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=5, help="timed rounds, alternating untraced and traced")
    args = ap.parse_args()

    model = build(args)
    device = next(model.parameters()).device
    layers = find_moe_layers(model)
    geometry = moe_geometry(model, layers)
    recorder = RoutingRecorder(layers, geometry.top_k, lookahead=1)
    vocab = model.config.get_text_config().vocab_size
    results = []
    for batch in args.batch_size:
        gen = torch.Generator().manual_seed(batch)
        ids = torch.randint(10, vocab, (batch, args.prompt_len), generator=gen).to(device)
        mask = torch.ones_like(ids)
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                  do_sample=False, pad_token_id=0)

        def untraced():
            model.generate(**kw)

        def traced():
            with recorder:
                out = model.generate(**kw)
            rows_from_records(recorder.pop(), ids, mask, out[:, ids.shape[1]:], [], lookahead=1)

        times = {"untraced": [], "traced": []}
        for rep in range(args.reps + 1):
            for name, fn in (("untraced", untraced), ("traced", traced)):
                sync(device)
                t = time.perf_counter()
                fn()
                sync(device)
                if rep:  # the first round warms up
                    times[name].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        best = {k: min(v) for k, v in times.items()}
        results.append({"batch_size": batch, "untraced_median_s": med["untraced"], "traced_median_s": med["traced"],
                        "ratio_of_medians": med["traced"] / med["untraced"],
                        "ratio_of_minima": best["traced"] / best["untraced"], "runs": times})
        print(f"batch {batch:3d}  untraced {med['untraced']:.3f}s  traced {med['traced']:.3f}s (medians of "
              f"{args.reps})  overhead ratio {med['traced'] / med['untraced']:.3f}x median, "
              f"{best['traced'] / best['untraced']:.3f}x min", flush=True)

    report = {
        "benchmark": "trace_overhead", "model": args.shape or args.model,
        "layers": geometry.num_layers, "experts": geometry.num_experts, "top_k": geometry.top_k,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(), "dtype": str(next(model.parameters()).dtype),
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "experts_implementation": model.config._experts_implementation,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "results": results,
    }
    write_result(args.out, report)


if __name__ == "__main__":
    main()
