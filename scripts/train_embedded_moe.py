"""Re-create the embedded default model: a tiny Qwen3-MoE trained on the built-in task samples.

    python scripts/train_embedded_moe.py            # writes duoserve/embedded/tiny-moe/

Settings (all below, none hidden): byte-level BPE tokenizer with 1024 tokens trained on the sample
text; Qwen3-MoE with 8 layers, all MoE, 16 experts, top-4, hidden 64, expert width 32, 4 heads;
AdamW (lr 3e-3, cosine, 60 warm-up steps), 16 x 256-token packed sequences a step, 1200 steps,
router load-balancing loss at coefficient 0.05. Training text: prompt + reference answer + EOS
from 6000 rows of each task (seed 1; the built-in trace samples use seed 0).

Deterministic on one machine and torch build: the same seed, data, thread count and step order
give the same weights (tests/test_embedded.py checks a short run bit for bit; two full runs gave
the same model.safetensors). On the 2-core CI machine the full run took 954-994 s (see README).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from duoserve.data.tasks import TASKS
from duoserve.embedded import EMBEDDED_MODEL

EOS, PAD = "<|endoftext|>", "<|pad|>"
VOCAB, SEQ, BATCH, STEPS, LR, WARMUP = 1024, 256, 16, 1200, 3e-3, 60
ROWS_PER_TASK, DATA_SEED, SEED = 6000, 1, 0


def training_texts() -> list[str]:
    texts = []
    for task in TASKS.values():
        texts += [task.prompt(r) + task.reference(r) for r in task.sample(ROWS_PER_TASK, DATA_SEED)]
    return texts


def train_tokenizer(texts: list[str], vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD,
                                   padding_side="left", model_max_length=2048)


def model_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, router_aux_loss_coef=0.05, output_router_logits=False,
        max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def packed_batches(texts: list[str], tokenizer: PreTrainedTokenizerFast, generator: torch.Generator,
                   seq: int = SEQ, batch: int = BATCH):
    """Endless batch x seq blocks of the texts' tokens (each text ends in EOS), in seeded random order."""
    ids = []
    for encoded in tokenizer(texts)["input_ids"]:
        ids += encoded + [tokenizer.eos_token_id]
    stream = torch.tensor(ids)
    blocks = stream[: len(stream) // seq * seq].view(-1, seq)  # N blocks x seq tokens
    while True:
        for chunk in torch.randperm(len(blocks), generator=generator).split(batch):
            if len(chunk) == batch:
                yield blocks[chunk]


def per_layer_balance_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int) -> torch.Tensor:
    """transformers' load-balancing loss taken per layer, then averaged over layers (k when balanced). Given all
    layers at once it pools their tokens first, which evens out expert e summed over layers and leaves each layer
    free to crowd onto a few experts."""
    return torch.stack([load_balancing_loss_func((logits,), num_experts, top_k) for logits in router_logits]).mean()


def train(model: torch.nn.Module, batches, steps: int, lr: float, warmup: int, start: float,
          max_seconds: float | None = None, per_layer_balance: float = 0.0) -> tuple[float, int]:
    """AdamW with warm-up and cosine decay on the LM loss plus the router's load-balancing loss (transformers'
    pooled one at the config's coefficient, and ``per_layer_balance`` times ``per_layer_balance_loss``), on the
    model's device; stops early once ``max_seconds`` since ``start`` have passed. Returns the last loss and steps
    done."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    model.train()
    for step in range(steps):
        x = next(batches).to(model.device)
        out = model(input_ids=x, labels=x, output_router_logits=True)
        layer_aux = per_layer_balance_loss(out.router_logits, model.config.num_experts,
                                           model.config.num_experts_per_tok) if per_layer_balance else None
        loss = out.loss if layer_aux is None else out.loss + per_layer_balance * layer_aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        late = max_seconds is not None and time.time() - start > max_seconds
        if step % 50 == 0 or step == steps - 1 or late:
            per_layer = "" if layer_aux is None else f"  per-layer aux {layer_aux.item():.3f}"
            print(f"step {step:5d}  loss {out.loss.item():.3f}  aux {out.aux_loss.item():.3f}{per_layer}  "
                  f"{time.time() - start:.0f}s", flush=True)
        if late:
            print(f"stopped after {step + 1} of {steps} steps: the {max_seconds:.0f} s budget is spent", flush=True)
            break
    model.eval()
    return out.loss.item(), step + 1


def save(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, out: Path, record: dict) -> None:
    """The model (with a greedy generation config), its tokenizer, and ``record`` as training.json."""
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def main(out: Path, steps: int) -> None:
    torch.manual_seed(SEED)
    start = time.time()
    texts = training_texts()
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(SEED)).tolist()
    texts = [texts[i] for i in order]
    tokenizer = train_tokenizer(texts)
    model = Qwen3MoeForCausalLM(model_config(tokenizer))
    # eager experts: bitwise reproducible on CPU; grouped_mm is ~1.7x faster there but not deterministic
    model.set_experts_implementation("eager")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer {len(tokenizer)} tokens; model {n_params / 1e6:.2f}M parameters")

    batches = packed_batches(texts, tokenizer, torch.Generator().manual_seed(SEED))
    final_loss, _ = train(model, batches, steps, LR, WARMUP, start)
    save(model, tokenizer, out, {
        "script": "scripts/train_embedded_moe.py", "steps": steps, "seq": SEQ, "batch": BATCH, "lr": LR,
        "rows_per_task": ROWS_PER_TASK, "data_seed": DATA_SEED, "seed": SEED, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "seconds": round(time.time() - start), "final_loss": round(final_loss, 4),
    })
    print(f"saved to {out} in {time.time() - start:.0f}s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=EMBEDDED_MODEL)
    ap.add_argument("--steps", type=int, default=STEPS)
    a = ap.parse_args()
    main(a.out, a.steps)
