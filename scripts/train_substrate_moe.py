"""Train the larger substrate: a Qwen3-MoE of real-model shape for predictor studies, on one GPU in minutes.

    python scripts/train_substrate_moe.py --out substrate/        # on a CUDA machine (about 6 minutes on an H200)

The embedded default (8 layers, 16 experts, top-4, hidden 64) routes far more simply than a real MoE,
so the predictor families are also compared on this one. Settings (all below, none hidden):
byte-level BPE tokenizer with 4096 tokens; Qwen3-MoE with 16 layers, all MoE, 64 experts, top-8,
hidden 256, expert width 128, 8 heads (4 key-value heads); AdamW (lr 2e-3, cosine, 100 warm-up steps),
2000 steps of 32 x 512-token packed sequences, a load-balancing loss taken per layer at coefficient 0.05
(``per_layer_balance_loss``; transformers' own, which pools all layers' router logits before balancing,
is off), bf16 weights (on CUDA).
Training text, shuffled with the seed: prompt + reference answer + EOS from 20,000 rows of each task
(data seed 1; the built-in trace samples use seed 0), and the Python standard library's own sources
(every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, each cut to 200,000 characters; present on
every machine, the exact text depends on the Python version, which ``training.json`` records).

Routing health of the committed trace (``duoserve-eval health``): every layer uses all 64 experts, the
busiest expert of a layer carries at most 2.1x the uniform load, and the tasks differ (total variation
0.14-0.23 per layer). With transformers' pooled loss instead (coefficient 0.02, 3000 steps) the busiest
expert reached 7.3x and a layer used only 49 experts: pooling evens out expert e summed over layers and
leaves each layer free to crowd onto a few. Per-layer coefficient 0.2 balanced further (1.7x) at a
worse loss (1.15 against 1.07) and less task difference (mean 0.146 against 0.180).

The weights are not committed: run this, then trace the result with ``duoserve-trace collect --model substrate/`` (see benchmarks/substrate.sh).
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import torch
from train_embedded_moe import packed_batches, save, train, train_tokenizer
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

from duoserve.data.tasks import TASKS

VOCAB, SEQ, BATCH, STEPS, LR, WARMUP = 4096, 512, 32, 2000, 2e-3, 100
ROWS_PER_TASK, DATA_SEED, SEED, LAYER_AUX = 20_000, 1, 0, 0.05
MAX_SOURCE_CHARS = 200_000  # longer standard-library files are cut: no one file dominates the text


def training_texts(rows_per_task: int, max_files: int | None) -> list[str]:
    """Task prompts with their answers, then the standard library's sources (sorted by path)."""
    texts = []
    for task in TASKS.values():
        texts += [task.prompt(r) + task.reference(r) for r in task.sample(rows_per_task, DATA_SEED)]
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:max_files]:
        try:
            texts.append(path.read_text(encoding="utf-8")[:MAX_SOURCE_CHARS])
        except (UnicodeDecodeError, OSError):  # a few test fixtures are deliberately undecodable
            continue
    return texts


def model_config(tokenizer: PreTrainedTokenizerFast, layers: int, experts: int, top_k: int,
                 hidden: int) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
        num_experts=experts, num_experts_per_tok=top_k, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, router_aux_loss_coef=0.0, output_router_logits=False,
        max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def main(out: Path, steps: int, device: str, batch: int, rows_per_task: int, max_files: int | None,
         max_seconds: float | None = None, layers: int = 16, experts: int = 64, top_k: int = 8,
         hidden: int = 256, layer_aux: float = LAYER_AUX) -> None:
    torch.manual_seed(SEED)
    start = time.time()
    texts = training_texts(rows_per_task, max_files)
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(SEED)).tolist()
    texts = [texts[i] for i in order]
    tokenizer = train_tokenizer(texts, VOCAB)
    model = Qwen3MoeForCausalLM(model_config(tokenizer, layers, experts, top_k, hidden))
    if device != "cpu":  # bf16 weights: torch's grouped GEMM, the fast expert path, is not autocast-aware
        model = model.to(device, torch.bfloat16)
        model.set_experts_implementation("grouped_mm")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{len(texts)} texts; tokenizer {len(tokenizer)} tokens; model {n_params / 1e6:.1f}M parameters; "
          f"{time.time() - start:.0f}s", flush=True)
    batches = packed_batches(texts, tokenizer, torch.Generator().manual_seed(SEED), SEQ, batch)
    final_loss, done = train(model, batches, steps, LR, WARMUP, start, max_seconds, layer_aux)
    save(model.float().cpu(), tokenizer, out, {
        "script": "scripts/train_substrate_moe.py", "steps": done, "planned_steps": steps, "seq": SEQ, "batch": batch,
        "lr": LR, "warmup": WARMUP, "per_layer_aux_loss_coef": layer_aux, "rows_per_task": rows_per_task, "stdlib_files": max_files or "all",
        "data_seed": DATA_SEED, "seed": SEED, "torch": torch.__version__, "python": sysconfig.get_python_version(),
        "device": torch.cuda.get_device_name(device) if device != "cpu" else "cpu",
        "seconds": round(time.time() - start), "final_loss": round(final_loss, 4),
    })
    print(f"saved to {out} in {time.time() - start:.0f}s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--rows-per-task", type=int, default=ROWS_PER_TASK)
    ap.add_argument("--stdlib-files", type=int, default=None, help="Use only the first N source files (smoke runs).")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="Stop training early after this long (from the start, data preparation included).")
    ap.add_argument("--per-layer-aux", type=float, default=LAYER_AUX,
                    help="Coefficient of the load-balancing loss taken per layer.")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    main(a.out, a.steps, a.device, a.batch, a.rows_per_task, a.stdlib_files, a.max_seconds,
         layer_aux=a.per_layer_aux)
