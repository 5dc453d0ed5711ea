"""Shared fixtures: small random MoE models of several architectures, saved like hub checkpoints."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from duoserve.embedded import EMBEDDED_MODEL

FLAME_MOE = Path(__file__).resolve().parents[2] / "shared" / "data" / "flame-moe"  # real routing, outside the repo
needs_flame_moe = pytest.mark.skipif(not FLAME_MOE.is_dir(),
                                     reason="FLAME-MoE's routing traces live in ../shared/data/flame-moe (absent)")

def load_benchmark(name: str):
    """A script of ``benchmarks/`` as a module (the folder is not a package)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COMMON = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=2048, initializer_range=0.2, tie_word_embeddings=False)


def _configs(vocab: int, pad: int, eos: int) -> dict:
    from transformers import (
        DeepseekV3Config,
        MixtralConfig,
        OlmoeConfig,
        Qwen3MoeConfig,
    )

    ids = dict(vocab_size=vocab, pad_token_id=pad, eos_token_id=eos, bos_token_id=eos)
    return {
        "mixtral": MixtralConfig(**COMMON, **ids, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2),
        "qwen3_moe": Qwen3MoeConfig(**COMMON, **ids, intermediate_size=32, moe_intermediate_size=16, num_experts=8,
                                    num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], head_dim=8),
        "olmoe": OlmoeConfig(**COMMON, **ids, intermediate_size=16, num_experts=8, num_experts_per_tok=2),
        # group-limited routing, a dense first layer and a shared expert
        "deepseek_v3": DeepseekV3Config(**{**COMMON, "num_hidden_layers": 4, "num_key_value_heads": 4}, **ids,
                                        intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8,
                                        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                                        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    }


ARCHS = ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3"]


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL)


def save_random_model(config, tokenizer, path: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # trained DeepSeek checkpoints have non-zero biases
            buffer.uniform_(-0.5, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def arch_models(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """One saved random checkpoint per architecture, with the embedded tokenizer."""
    root = tmp_path_factory.mktemp("models")
    configs = _configs(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    return {name: save_random_model(cfg, tokenizer, root / name) for name, cfg in configs.items()}


@pytest.fixture(scope="session")
def dense_model(tmp_path_factory, tokenizer) -> Path:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**COMMON, vocab_size=len(tokenizer), intermediate_size=32)
    return save_random_model(cfg, tokenizer, tmp_path_factory.mktemp("models") / "dense")


def write_trace(out: Path, ids, request_ids, datasets=None, phases=None, lookahead: int = 0, num_experts: int = 6,
                parts: int = 1):
    """A hand-built trace: ``ids`` N x L x k expert ids, one request id per row, in ``parts`` part files;
    returns the opened trace."""
    import numpy as np

    from duoserve.trace.format import TraceMeta, nextgate_column, nextgate_scores_column
    from duoserve.trace.writer import TraceWriter

    ids = np.asarray(ids, dtype=np.int16)
    N, L, k = ids.shape
    meta = TraceMeta(model="hand-built", num_layers=L, num_experts=num_experts, top_k=k,
                     decoder_indices=list(range(L)), datasets=[{"name": "squad", "source": "test"}],
                     lookahead=lookahead, nextgate_width=k if lookahead else 0)
    out.mkdir(parents=True)
    writer = TraceWriter(out, meta)
    cols = {
        "request_id": np.asarray(request_ids, dtype=np.int64),
        "dataset": np.array(datasets if datasets is not None else ["squad"] * N, dtype=object),
        "phase": np.array(phases if phases is not None else ["decode"] * N, dtype=object),
        "position": np.arange(N, dtype=np.int32), "token_id": np.arange(N, dtype=np.int32),
        "experts": ids.reshape(N, -1), "scores": np.full((N, L * k), 0.5, dtype=np.float16),
    }
    for d in range(1, lookahead + 1):  # a perfect guess, scored in router order
        cols[nextgate_column(d)] = ids[:, d:].reshape(N, -1)
        cols[nextgate_scores_column(d)] = np.tile(np.linspace(0.5, 0.1, k, dtype=np.float16), (N, L - d))
    for rows in np.array_split(np.arange(N), parts):
        writer.add({name: col[rows] for name, col in cols.items()})
        writer.flush()
    from duoserve.trace import open_trace

    return open_trace(out)


@pytest.fixture(scope="session")
def embedded_trace(tmp_path_factory):
    """The README's default trace of the embedded model (2.5% of each built-in sample), 16 decode steps, with next-gate
    guesses 2 layers deep (the default records 1)."""
    from duoserve.data.tasks import parse_datasets
    from duoserve.trace import open_trace
    from duoserve.trace.collect import CollectSettings, collect

    out = tmp_path_factory.mktemp("embedded") / "traces"
    collect(CollectSettings(datasets=parse_datasets(["squad-sample", "orca-math-sample"]), out=out,
                            max_new_tokens=16, lookahead=2, device="cpu"))
    return open_trace(out)


@pytest.fixture(scope="session")
def embedded_predictor(embedded_trace, tmp_path_factory):
    """A small predictor (one narrow layer, one epoch) fitted on the embedded trace: an artifact to hand commands."""
    from duoserve.train.fit import FitSettings, fit

    out = tmp_path_factory.mktemp("predictor") / "p"
    fit(FitSettings(traces=[embedded_trace.path], out=out, widths=(32,), epochs=1, progress=False, clean=True))
    return out
