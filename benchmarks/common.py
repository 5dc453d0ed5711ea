"""Shared by the benchmarks: real MoE model shapes (random weights, no hub needed) and result files.

Shape values copied from the models' published config.json files (architecture numbers only).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SHAPES = {
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "mixtral-8x7b": ("mixtral", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        rope_theta=1_000_000.0, max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False)),
}


def shape_config(name: str, num_layers: int | None = None, **overrides):
    """A transformers config of the named shape, optionally with fewer layers and other ``overrides`` (widths)."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    model_type, kwargs = SHAPES[name]
    if num_layers:
        kwargs = {**kwargs, "num_hidden_layers": num_layers}
    return AutoConfig.for_model(model_type, **{**kwargs, **overrides})


def write_result(path: Path | None, report: dict) -> None:
    """Write a benchmark's JSON result (if --out was given)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def random_routing(rng: np.random.Generator, n: int, L: int, E: int, k: int) -> np.ndarray:
    """n x L x k uniformly random top-k expert ids, distinct within a layer (as a router picks them)."""
    return np.argsort(rng.random((n, L, E), dtype=np.float32), axis=2)[..., :k]


def parser(doc: str, geometry: tuple[int, int, int] | None = (48, 128, 8)) -> argparse.ArgumentParser:
    """A benchmark's parser with --out (its JSON result) and, unless ``geometry`` is None,
    --layers/--experts/--top-k (default: Qwen3-30B-A3B's MoE geometry)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    if geometry is not None:
        for flag, default in zip(("--layers", "--experts", "--top-k"), geometry):
            ap.add_argument(flag, type=int, default=default)
    return ap
