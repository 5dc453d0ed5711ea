"""Quantized experts against the model's own: logits difference and greedy-token agreement, and the engine's
tokens against the dequantized model's.

    python benchmarks/quant_accuracy.py --out benchmarks/results/quant_accuracy_cpu.json          # CPU, float32
    python benchmarks/quant_accuracy.py --device cuda --dtype bfloat16 --out benchmarks/results/quant_accuracy_h200.json

On the embedded default with the built-in sample prompts: for each expert dtype, the model with its experts
quantized and dequantized (what the engine computes with) is compared with the original on one forward pass of
the prompts (mean and max absolute logit difference, and the share of positions whose arg-max agrees) and on
greedy generation (the share of generated tokens equal to the original's, position by position); then the
``duoserve`` and ``lru`` policies generate from the quantized stores, and their tokens are checked against
the dequantized model's (they must be equal).
"""

from __future__ import annotations

import copy

import torch

from duoserve.bench.results import parser, write_result
from duoserve.data.tasks import default_prompts
from duoserve.discovery import find_moe_layers
from duoserve.loading import load_model, resolve_device
from duoserve.runtime import POLICIES, OffloadEngine, offload, timed_generate
from duoserve.runtime.quant import EXPERT_DTYPES
from duoserve.runtime.store import drop_experts, put_experts


def main() -> None:
    ap = parser(__doc__, geometry=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    device = resolve_device(args.device)
    model, tokenizer = load_model("embedded", device="cpu", dtype=args.dtype)
    model.to(device)
    batch = tokenizer(default_prompts(args.prompts), return_tensors="pt", padding=True).to(device)

    def measure(net) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logits = net(**batch).logits.float()
        tokens = timed_generate(net, batch.input_ids, batch.attention_mask, args.new_tokens, fixed_length=True)[0]
        return logits, tokens[:, batch.input_ids.shape[1]:]

    base_logits, base_tokens = measure(model)
    live = batch.attention_mask.bool()  # padded positions are not compared
    rows = []
    for fmt in EXPERT_DTYPES[1:]:
        net = copy.deepcopy(model)
        layers = find_moe_layers(net)
        stores = offload(net, POLICIES["lru"], device, fmt)
        put_experts(layers, stores, device)
        logits, tokens = measure(net)
        diff = (logits - base_logits).abs()[live]
        engine_equal = {}
        drop_experts(layers)
        for policy in ("duoserve", "lru"):
            with OffloadEngine(net, stores, POLICIES[policy]):
                engine_tokens = timed_generate(net, batch.input_ids, batch.attention_mask, args.new_tokens,
                                               fixed_length=True)[0][:, batch.input_ids.shape[1]:]
            engine_equal[policy] = bool(torch.equal(engine_tokens, tokens))
        row = {"expert_dtype": fmt, "stored_bytes_ratio": stores[0].row_bytes / stores[0].layout.nbytes,
               "logit_abs_diff_mean": diff.mean().item(), "logit_abs_diff_max": diff.max().item(),
               "logit_std": base_logits[live].std().item(),
               "argmax_agreement": (logits.argmax(-1) == base_logits.argmax(-1))[live].float().mean().item(),
               "greedy_token_agreement": (tokens == base_tokens).float().mean().item(),
               "engine_equals_dequantized": engine_equal}
        print(f"{fmt}: stored bytes {row['stored_bytes_ratio']:.3f}x, logits |diff| mean "
              f"{row['logit_abs_diff_mean']:.4f} max {row['logit_abs_diff_max']:.3f} (logit std "
              f"{row['logit_std']:.2f}), arg-max agreement {row['argmax_agreement']:.3f}, greedy tokens agreement {row['greedy_token_agreement']:.3f}, engine "
              f"tokens equal the dequantized model's: {engine_equal}")
        rows.append(row)
    write_result(args.out, {"benchmark": "quant_accuracy", "model": "embedded", "device": str(device),
                            "dtype": str(next(model.parameters()).dtype), "prompts": args.prompts,
                            "new_tokens": args.new_tokens, "results": rows})


if __name__ == "__main__":
    main()
