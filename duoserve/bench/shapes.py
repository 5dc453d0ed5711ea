"""Real MoE model shapes, built with random weights from their configs (no hub, no checkpoint), and predictors of
a given geometry with random weights.

Shape values copied from the models' published config.json files (architecture numbers only).
"""

from __future__ import annotations

from pathlib import Path

import torch

from duoserve.predictor.model import PAPER_WIDTHS, ExpertPredictor, FeatureSpec

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
# Qwen3-30B-A3B's widths at the geometry (layers, experts, top-k) of a routing trace the engine replays, so that a
# replayed expert's bytes and compute are a real one's: the larger substrate's (benchmarks/data/substrate) and
# FLAME-MoE's (../shared/data/flame-moe), whose own models are too small to load a GPU as a served model does
REPLAY_SHAPES = {"qwen3-30b-a3b-substrate": (16, 64, 8), "qwen3-30b-a3b-flame": (25, 64, 6)}
SHAPES.update({name: ("qwen3_moe", {**SHAPES["qwen3-30b-a3b"][1], "num_hidden_layers": L, "num_experts": E,
                                    "num_experts_per_tok": k}) for name, (L, E, k) in REPLAY_SHAPES.items()})


def shape_config(name: str, num_layers: int | None = None, **overrides):
    """A transformers config of the named shape, optionally with fewer layers and other ``overrides`` (widths)."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    model_type, kwargs = SHAPES[name]
    if num_layers:
        kwargs = {**kwargs, "num_hidden_layers": num_layers}
    return AutoConfig.for_model(model_type, **{**kwargs, **overrides})


def save_shape(name: str, folder: str | Path, num_layers: int | None = None, **overrides) -> Path:
    """Write the named shape's config.json into ``folder``: a model path for ``--config-only`` runs."""
    shape_config(name, num_layers, **overrides).save_pretrained(folder)
    return Path(folder)


def model_source(spec: str, folder: str | Path) -> str:
    """What ``model_from_config`` builds for ``spec``: a named shape, its config written into ``folder``; anything
    else (a config's hub id or path, ``embedded``) as given."""
    return str(save_shape(spec, folder)) if spec in SHAPES else spec


def random_predictor(L: int, E: int, k: int, widths: tuple[int, ...] = PAPER_WIDTHS,
                     family: str = "paper", lookahead: int = 1) -> ExpertPredictor:
    """A predictor of the given geometry, family and look-ahead depth with random weights and statistics (seeded):
    its cost, not its accuracy. Hybrid and residual ones take 2k next-gate ids and scores."""
    torch.manual_seed(0)
    pop = torch.rand(L, E)
    aff = torch.rand(L - 1, E, E)
    spec = FeatureSpec(L, E, k, L - 1, family=family, nextgate_width=2 * k if family != "paper" else 0,
                       lookahead=lookahead)
    model = ExpertPredictor(spec, widths, 0.1, pop / pop.sum(1, keepdim=True), aff / aff.sum(2, keepdim=True))
    if family == "residual":  # a trained correction is not zero
        torch.nn.init.normal_(model.mlp[-1].weight, std=0.01)
    for m in model.mlp:
        if isinstance(m, torch.nn.BatchNorm1d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 2.0)
    return model.eval()


if __name__ == "__main__":  # python -m duoserve.bench.shapes NAME FOLDER: a config folder for shell scripts
    import sys

    save_shape(sys.argv[1], sys.argv[2])
