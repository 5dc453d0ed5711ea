"""Fewer bytes per token: quantized expert stores and a cache with pinned experts."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from duoserve.cli.run import app as run_app
from duoserve.discovery import find_moe_layers
from duoserve.features.stats import RoutingStats
from duoserve.loading import load_model
from duoserve.runtime import POLICIES, EngineSettings, OffloadEngine, offload, timed_generate
from duoserve.runtime.cache import ExpertCache, popular_keys
from duoserve.runtime.quant import (BLOCK, QuantizedExperts, QuantLayout, dequantize, dequantize_into, dequantizer,
                                    make_store, quantize, stage_buffers)
from duoserve.runtime.scheduler import QUANTIZED_CACHE_BYTES, default_capacity
from duoserve.runtime.store import ExpertLayout, HostExperts, drop_experts, expert_params, put_experts
from duoserve.runtime.streams import Streams
from tests.conftest import load_benchmark

PROMPTS = ["Question: what is 3 + 4?", "Context: Bob lives in Paris. Question: where does Bob live?\nAnswer:"]
PACKED = [name for name, p in POLICIES.items() if p.quantizable]
runner = CliRunner()


@pytest.fixture(scope="module")
def embedded():
    return load_model("embedded", device="cpu")


def _generate(model, tokenizer, new_tokens: int = 12, device: str = "cpu"):
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True).to(device)
    return timed_generate(model, batch.input_ids, batch.attention_mask, new_tokens)[0]


@pytest.mark.parametrize("shape", [(3, 256, 384), (2, 64, 96)])  # whole 128-blocks, and dims that are not
def test_fp8_round_trip_is_within_e4m3s_rounding_of_each_block(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 0, shape[-1])
    codes, scale = quantize(w, "fp8")
    assert codes.dtype == torch.uint8 and codes.shape == (shape[0], shape[1] * shape[2])  # one byte a weight
    br, bc = (BLOCK if d % BLOCK == 0 else d for d in shape[1:])
    assert scale.shape == (shape[0], shape[1] // br, shape[2] // bc)
    layout = ExpertLayout.of({"w": w})
    stored = QuantizedExperts.quantize({"w": w}, "fp8", pin=False)
    back = stored.params()["w"]
    per_weight = scale.repeat_interleave(br, 1).repeat_interleave(bc, 2)  # n x R x C: each weight's block scale
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, and subnormals step by 2^-9 of the block scale
    assert ((back - w).abs() <= w.abs() / 16 + per_weight * 2 ** -9 + 1e-7).all()
    assert stored.row_bytes < 0.26 * layout.nbytes + 64  # fp32 model: a quarter of its bytes, plus scales


def test_int4_round_trip_is_within_half_a_step_and_packs_two_weights_a_byte():
    w = torch.randn(4, 128, 256, generator=torch.Generator().manual_seed(1))
    codes, scale = quantize(w, "int4")
    assert codes.shape == (4, 128 * 256 // 2) and scale.shape == (4, 128, 2)
    back = QuantizedExperts.quantize({"w": w}, "int4", pin=False).params()["w"]
    step = scale.repeat_interleave(BLOCK, 2)  # 4 x 128 x 256: each weight's group scale
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    # the low nibble is the even column: flipping it moves exactly that weight by one step
    flipped = codes.clone()
    flipped[0, 0] ^= 1
    q = QuantLayout.of(ExpertLayout.of({"w": w}), "int4")
    stored = torch.zeros(4, q.nbytes, dtype=torch.uint8)
    seg = q.segments[0]
    stored[:, seg.offset:seg.offset + seg.nbytes] = flipped
    stored[:, seg.scale_offset:seg.scale_offset + seg.scale_nbytes] = scale.reshape(4, -1).view(torch.uint8)
    out = torch.empty(4, ExpertLayout.of({"w": w}).numel)
    dequantize(stored, q, ExpertLayout.of({"w": w}), out)
    moved = (out.view(4, 128, 256) - back).abs() > 0
    assert moved.sum() == 1 and moved[0, 0, 0]


def _mixed_store(fmt: str, dtype: torch.dtype = torch.bfloat16) -> QuantizedExperts:
    """Experts with whole 128-blocks, dims that are not, wide-ranging magnitudes and a bias (stored raw)."""
    g = torch.Generator().manual_seed(2)
    params = {"gate_up_proj": torch.randn(4, 256, 384, generator=g) * torch.logspace(-4, 1, 384),
              "down_proj": torch.randn(4, 96, 64, generator=g), "bias": torch.randn(4, 256, generator=g)}
    return QuantizedExperts.quantize({name: p.to(dtype) for name, p in params.items()}, fmt, pin=False)


def _kernels_write_the_eager_rows(kernels, device: torch.device, dtypes: tuple[torch.dtype, ...]) -> None:
    """``kernels`` (``quant_kernels.dequantize_into``) write, on ``device``, what the CPU's eager path writes into a
    cache's slots (every other row, from the last), bit for bit, and nothing else."""
    for dtype in dtypes:
        for fmt in ("fp8", "int4"):
            store = _mixed_store(fmt, dtype)
            q, layout = store.qlayout, store.layout
            for n in (4, 3, 1):
                stored = store.packed[:n]
                eager = torch.full((n, layout.numel), 7.0, dtype=dtype)
                dequantize(stored, q, layout, eager)
                slots = torch.arange(2 * n - 1, 0, -2)  # n
                table = torch.full((2 * n, layout.numel), 7.0, dtype=dtype)
                dequantize_into(stored, slots, q, layout, table)  # the CPU's path
                assert torch.equal(table[slots], eager) and (table[slots - 1] == 7).all()  # those rows, no others
                on_device = torch.full_like(table, 7.0, device=device)  # its own rows, on the CPU too
                kernels(stored.to(device), slots.to(device), q, layout, on_device)
                assert torch.equal(on_device.cpu(), table), (dtype, fmt, n)  # one rounding, the same one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's dequantization kernels run on a CUDA device")
def test_the_gpus_dequantization_kernels_write_the_cpus_eager_rows_bit_for_bit():
    cuda = torch.device("cuda")
    _kernels_write_the_eager_rows(dequantizer(cuda), cuda, (torch.bfloat16, torch.float16, torch.float32))


_UNDER_INTERPRETER = """
import torch
from duoserve.runtime import quant_kernels
from tests.test_quant import _kernels_write_the_eager_rows
_kernels_write_the_eager_rows(quant_kernels.dequantize_into, torch.device("cpu"), (torch.float16, torch.float32))
print("equal")
"""


def test_the_gpus_dequantization_kernels_under_tritons_interpreter_write_the_eager_rows():
    """The kernels' indexing (blocks, scales, nibbles, slots) checked on the CPU: Triton's interpreter runs them on
    host tensors. Exact on fp16 and fp32 caches; bf16 is the GPU test's (the interpreter casts to it by truncation)."""
    aside = Path(sys.prefix) / "triton-interpreter"  # where make setup-dev puts Triton, apart from the venv's packages
    path = [str(aside)] if aside.is_dir() else []
    if not path and importlib.util.find_spec("triton") is None:
        pytest.skip("no Triton to run its kernels' interpreter (make setup-dev installs it on Linux x86-64)")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    run = subprocess.run([sys.executable, "-c", _UNDER_INTERPRETER], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("equal"), run.stderr[-3000:]


def test_bf16_stored_rows_are_half_and_a_quarter_and_fetches_dequantize_as_the_reference_does():
    params = {"gate_up_proj": torch.randn(4, 256, 128).bfloat16(), "down_proj": torch.randn(4, 128, 128).bfloat16(),
              "bias": torch.randn(4, 256).bfloat16()}
    plain = HostExperts.pack(params, pin=False)
    for fmt, ratio in (("fp8", 0.51), ("int4", 0.28)):
        store = QuantizedExperts.quantize(params, fmt, pin=False)
        assert store.row_bytes <= ratio * plain.row_bytes
        assert torch.equal(store.params()["bias"], params["bias"])  # one-dimensional: stored as it is
        reference = store.params()
        # one expert; a group in one pass; in passes of two; each straight into its slot (experts over STAGE_BYTES)
        for chunk, experts in ((store.chunk, [3]), (store.chunk, [3, 0, 2]), (2, [3, 0, 2]), (1, [3, 0, 2])):
            store.chunk = chunk
            cache = ExpertCache(plain.layout, slots=4, streams=Streams(torch.device("cpu")))
            slots = cache.fetch(0, experts, store, "decode", keep=set())
            for e, slot in zip(experts, slots):
                for name in params:
                    assert torch.equal(cache.views[name][slot], reference[name][e]), (fmt, chunk, name)
            assert cache.stats.bytes["decode"] == len(experts) * store.row_bytes  # bytes that crossed, not slots'
        assert torch.equal(cache.buffer[3], torch.zeros_like(cache.buffer[3]))  # the spare slot is untouched
        other = QuantizedExperts.quantize(params, fmt, pin=False)  # another layer's store: same staging
        other.chunk = store.chunk
        cache.fetch(1, [1, 2], other, "decode", keep={(0, e) for e in (3, 0)})
        assert len(cache.scratch) == 1


def _quantized_runs(model, tokenizer, fmt: str, device: str) -> tuple[torch.Tensor, dict, int]:
    """The dequantized model's tokens (all-resident), and each packed policy's (tokens, stats) on the same stores;
    and the model dtype's bytes of one expert."""
    layers = find_moe_layers(model)
    model.to(device)
    stores = offload(model, POLICIES["lru"], device, fmt)
    put_experts(layers, stores, device)  # the model holds the dequantized experts: the reference
    reference = _generate(model, tokenizer, device=device)
    drop_experts(layers)
    runs = {}
    try:
        for name in PACKED:
            with OffloadEngine(model, stores, POLICIES[name]) as engine:
                runs[name] = (_generate(model, tokenizer, device=device), engine.stats())
    finally:
        put_experts(layers, stores, device)
    return reference, runs, stores[0].layout.nbytes


def _check_quantized_runs(reference, runs, row_bytes: int, model_bytes: int) -> None:
    for name, (tokens, stats) in runs.items():
        assert torch.equal(tokens, reference), name
        assert stats["bytes_h2d"]["decode"] == stats["copies"]["decode"] * row_bytes  # stored bytes crossed
        assert row_bytes < model_bytes


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantized_experts_generate_the_dequantized_models_tokens(embedded, fmt):
    model, tokenizer = copy.deepcopy(embedded[0]), embedded[1]
    original = _generate(model, tokenizer)
    reference, runs, model_bytes = _quantized_runs(model, tokenizer, fmt, "cpu")
    row_bytes = QuantLayout.of(ExpertLayout.of(expert_params(find_moe_layers(model)[0].experts)), fmt).nbytes
    _check_quantized_runs(reference, runs, row_bytes, model_bytes)
    # a quantized model still: its greedy tokens mostly agree with the original's, fp8's more than int4's may
    agree = (reference == original).float().mean().item()
    assert agree > (0.9 if fmt == "fp8" else 0.5), agree


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies dequantized on the copy stream need a CUDA device")
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantized_experts_on_cuda_generate_the_dequantized_models_tokens(embedded, fmt):
    model, tokenizer = copy.deepcopy(embedded[0]), embedded[1]
    model.to(torch.bfloat16)
    reference, runs, model_bytes = _quantized_runs(model, tokenizer, fmt, "cuda")
    row_bytes = QuantLayout.of(ExpertLayout.of(expert_params(find_moe_layers(model)[0].experts)), fmt).nbytes
    _check_quantized_runs(reference, runs, row_bytes, model_bytes)


def test_quantized_logits_are_closer_for_fp8_than_int4(embedded):
    model, tokenizer = embedded
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        base = model(**batch).logits
    diffs = {}
    for fmt in ("fp8", "int4"):
        net = copy.deepcopy(model)
        put_experts(find_moe_layers(net), offload(net, POLICIES["lru"], "cpu", fmt), "cpu")
        with torch.no_grad():
            diffs[fmt] = (net(**batch).logits - base).abs().mean().item()
    assert 0 < diffs["fp8"] < diffs["int4"]


def test_quantized_experts_need_packed_stores(embedded):
    model = copy.deepcopy(embedded[0])
    with pytest.raises(ValueError, match="need a policy with packed stores"):
        offload(model, POLICIES["accelerate"], "cpu", "int4")
    with pytest.raises(ValueError, match="unknown expert dtype"):
        offload(model, POLICIES["lru"], "cpu", "int3")


def test_popular_keys_rank_every_layers_experts_on_one_scale():
    popularity = np.array([[0.5, 0.1, 0.4], [0.2, 0.7, 0.1]])
    assert popular_keys(popularity) == [(1, 1), (0, 0), (0, 2), (1, 0), (0, 1), (1, 2)]


def _pinned_engine(model, policy: str, slots: int, keys, fmt: str = "model"):
    stores = offload(model, POLICIES[policy], "cpu", fmt)
    budget = slots * stores[0].layout.nbytes
    return stores, OffloadEngine(model, stores, POLICIES[policy], settings=EngineSettings(gpu_expert_budget=budget,
                                                                                         pin=tuple(keys)))


@pytest.mark.parametrize("policy", ["lru", "duoserve"])
def test_pinned_experts_stay_resident_within_the_budget_and_tokens_do_not_change(embedded, policy):
    model, tokenizer = copy.deepcopy(embedded[0]), embedded[1]
    reference = _generate(model, tokenizer)
    layers = find_moe_layers(model)
    L, E, k = len(layers), layers[0].experts.num_experts, model.config.num_experts_per_tok
    rng = np.random.default_rng(0)
    keys = popular_keys(rng.random((L, E)))
    stores, engine = _pinned_engine(model, policy, slots=2 * k + 5, keys=keys)
    try:
        cache = engine.cache
        pinned = {key: cache.slot_of[key] for key in keys[:5]}
        assert cache.pinned == set(pinned) and cache.slots == 2 * k + 5  # 5 beyond the (1 + lookahead) x k
        assert cache.nbytes <= engine.settings.gpu_expert_budget
        with engine:
            tokens = _generate(model, tokenizer)
            stats = engine.stats()
        assert torch.equal(tokens, reference)
        assert stats["pinned_experts"] == 5 and stats["copies"]["decode"] > 0  # the open slots did turn over
        assert {key: cache.slot_of.get(key) for key in pinned} == pinned  # never a victim
        for (layer, e), slot in pinned.items():  # and still holding that expert's weights
            for name, value in stores[layer].params().items():
                assert torch.equal(cache.views[name][slot], value[e])
    finally:
        put_experts(layers, stores, "cpu")


def test_pinning_hits_where_lru_would_miss(embedded):
    """The same hand-built calls with and without pinning: the pinned experts are hits every time, and the copies
    saved are exactly their misses."""
    model = copy.deepcopy(embedded[0])
    layers = find_moe_layers(model)
    hidden = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    weights = torch.full((1, 4), 0.25)
    calls = [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 8, 9], [10, 11, 12, 13], [0, 1, 2, 3]]  # layer 2; 0 and 1 recur
    copies = {}
    for keys in ([], [(2, 0), (2, 1), (5, 7)]):  # 11 slots: 8 open and 3 pinned, or 11 open
        stores, engine = _pinned_engine(model, "lru", slots=8 + 3, keys=keys)
        try:
            with engine:
                engine.phase = "decode"
                for ids in calls:
                    engine.run_layer(2, hidden, torch.tensor([ids]), weights)
                copies[bool(keys)] = engine.cache.stats.copies["decode"]
                assert engine.cache.pinned == set(keys)
        finally:
            put_experts(layers, stores, "cpu")
    # both: 10-13 evict 2 and 3 (the least recent), which the last call copies again; pinned, 0 and 1 are never
    # copied: 4 + 4 + 2 + 4 + 2 copies against 2 + 4 + 2 + 4 + 2
    assert copies[False] == 16 and copies[True] == 14


def test_pinning_is_refused_without_room_or_on_a_policy_with_no_cache(embedded):
    model = copy.deepcopy(embedded[0])
    layers = find_moe_layers(model)
    with pytest.raises(ValueError, match="needs a GPU expert budget"):
        EngineSettings(pin=((0, 1),))
    for policy, slots, match in (("lru", 8, "leaves none to pin"), ("on-demand", 12, "keeps no cache")):
        stores = offload(model, POLICIES[policy], "cpu")
        try:
            with pytest.raises(ValueError, match=match):
                OffloadEngine(model, stores, POLICIES[policy], settings=EngineSettings(
                    gpu_expert_budget=slots * stores[0].layout.nbytes, pin=((0, 1),)))
        finally:
            put_experts(layers, stores, "cpu")


def test_cli_generates_with_int4_experts_and_pinned_popular_experts(tmp_path, embedded):
    layers = find_moe_layers(embedded[0])
    L, E = len(layers), layers[0].experts.num_experts
    counts = np.random.default_rng(0).integers(1, 100, size=(L, E))
    stats = tmp_path / "stats.safetensors"
    RoutingStats(counts, np.zeros((L - 1, E, E), dtype=np.int64), 100).save(stats)
    out = tmp_path / "gen.json"
    nbytes = ExpertLayout.of({n: p for n, p in layers[0].experts.named_parameters(recurse=False)
                              if p.dim() >= 2}).nbytes
    result = runner.invoke(run_app, ["generate", "--new-tokens", "6", "--policy", "lru", "--expert-dtype", "int4",
                                     "--gpu-expert-budget", str(12 * nbytes), "--pin", f"popularity:{stats}",
                                     "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["pinned_experts"] == 4 and "experts pinned" in result.output
    bad = runner.invoke(run_app, ["generate", "--pin", "popularity:/nowhere.safetensors",
                                  "--gpu-expert-budget", "1MiB"])
    assert bad.exit_code != 0 and "no stats file" in bad.output
    bad = runner.invoke(run_app, ["generate", "--policy", "accelerate", "--expert-dtype", "fp8"])
    assert bad.exit_code != 0 and "packed stores" in bad.output


def test_bench_runs_each_expert_dtype_and_checks_its_ratios(tmp_path, arch_models):
    out = tmp_path / "bench.json"
    result = runner.invoke(run_app, ["bench", "--model", str(arch_models["mixtral"]), "--config-only", "--layers", "2",
                                     "--routing", "random", "--policy", "duoserve", "--policy", "accelerate",
                                     "--policy", "all-resident", "--expert-dtype", "model", "--expert-dtype", "fp8",
                                     "--expert-dtype", "int4", "--prompt-len", "16", "--new-tokens", "4",
                                     "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    runs = {(r["policy"], r["expert_dtype"]): r for r in saved["runs"]}
    assert set(runs) == {("duoserve", f) for f in ("model", "fp8", "int4")} | {("accelerate", "model"),
                                                                                ("all-resident", "model")}
    stored = saved["geometry"]["stored_expert_mb"]
    assert saved["pin_keys"] == 0 and "pin" not in saved  # a pin list is counted, not dumped
    for fmt in ("fp8", "int4"):
        q, m = runs[("duoserve", fmt)], runs[("duoserve", "model")]
        # a quantized store's default cache is larger (its prefill groups), so the copies may differ; each copy moves
        # exactly the stored row
        assert q["cache_slots"] >= m["cache_slots"]
        for phase in ("prefill", "decode"):
            assert q["copies"][phase] and q["bytes_h2d"][phase] == pytest.approx(q["copies"][phase] * stored[fmt] * 1e6)
        ratio = q["bytes_h2d"]["decode"] / m["bytes_h2d"]["decode"]
        checks = {t["target"]: t for t in saved["targets"] if t["expert_dtype"] == fmt}
        assert checks[f"{fmt} decode bytes per token <= "
                      f"{0.55 if fmt == 'fp8' else 0.3}x of the model dtype's"]["value"] == pytest.approx(ratio)
        assert "TTFT >= 1.8x better than accelerate" in checks  # accelerate has no dtype: compared with each


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """R x C e4m3 codes and the (R/128) x (C/128) scales an FP8 checkpoint stores (``weight_scale_inv``: a block's
    absolute maximum over 448, what its codes are multiplied by)."""
    R, C = w.shape
    blocks = w.reshape(R // 128, 128, C // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    return (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(R, C), scale.float()


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint in the official FP8 checkpoints' schema: every projection's weight as e4m3 codes
    with a ``weight_scale_inv`` per 128 x 128 block, per-expert tensors, the routers and head unquantized."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    from duoserve.loading import resolve_model

    folder = tmp_path_factory.mktemp("fp8")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("embedded"))
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                            moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=128, num_experts=8, num_experts_per_tok=2,
                            max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    weights = {}
    for name, w in load_file(folder / "model.safetensors").items():
        if name.endswith("_proj.weight"):
            weights[name], weights[name.replace(".weight", ".weight_scale_inv")] = _fp8_blocks(w)
        else:
            weights[name] = w
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    meta = json.loads((folder / "config.json").read_text())
    meta["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "mlp.gate"]}
    (folder / "config.json").write_text(json.dumps(meta))
    return folder, weights


def test_an_fp8_checkpoint_loads_as_its_own_weights_and_its_experts_stay_fp8(fp8_checkpoint):
    from duoserve.loading import checkpoint_experts
    from duoserve.runtime.generation import generate

    folder, weights = fp8_checkpoint
    assert checkpoint_experts(str(folder)) == "fp8" and checkpoint_experts("embedded") == "model"
    model, _ = load_model(str(folder), device="cpu", dtype="float32")
    experts = find_moe_layers(model)[1].experts  # transformers' own experts module, dequantized
    I = experts.down_proj.shape[2]
    for e in range(experts.num_experts):
        for part, rows in (("gate", slice(0, I)), ("up", slice(I, 2 * I))):
            key = f"model.layers.1.mlp.experts.{e}.{part}_proj.weight"
            codes, scale = weights[key], weights[key.replace(".weight", ".weight_scale_inv")]
            expected = (codes.float().reshape(1, 128, 1, 128) * scale[:, None, :, None]).reshape(codes.shape)
            assert torch.equal(experts.gate_up_proj[e, rows], expected)
    # stored as fp8 again, the experts are the checkpoint's weights exactly: its codes, its scales
    params = {n: p.detach() for n, p in expert_params(experts).items()}
    stored = QuantizedExperts.quantize(params, "fp8", pin=False).params("cpu")
    assert all(torch.equal(stored[n], params[n]) for n in params)
    # the runtime picks fp8 for such a checkpoint, and its tokens are the dequantized model's
    offloaded = generate(str(folder), PROMPTS, "duoserve", new_tokens=8, device="cpu", dtype="float32")
    resident = generate(str(folder), PROMPTS, "all-resident", new_tokens=8, device="cpu", dtype="float32")
    assert offloaded.expert_dtype == "fp8" and offloaded.counters["bytes_h2d"]["decode"] > 0
    assert offloaded.texts == resident.texts


def test_a_checkpoint_in_another_quantization_is_refused_with_what_to_do(fp8_checkpoint, tmp_path):
    import shutil

    from duoserve.loading import ModelLoadError, checkpoint_experts

    folder = tmp_path / "awq"
    shutil.copytree(fp8_checkpoint[0], folder)
    meta = json.loads((folder / "config.json").read_text())
    meta["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match="quantized with awq.*unquantized checkpoint"):
        checkpoint_experts(str(folder))
    with pytest.raises(ModelLoadError, match="quantized with awq"):
        load_model(str(folder), device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="transformers swaps in its own FP8 experts only on a GPU")
def test_an_fp8_checkpoint_on_cuda_keeps_the_experts_module_the_engine_drives(fp8_checkpoint):
    from duoserve.runtime.generation import generate

    folder, _ = fp8_checkpoint
    model, _ = load_model(str(folder), device="cuda", dtype="bfloat16")
    experts = find_moe_layers(model)[0].experts
    assert type(experts).__name__ == "Qwen3MoeExperts" and experts.gate_up_proj.dtype == torch.bfloat16
    offloaded = generate(str(folder), PROMPTS, "duoserve", new_tokens=8, device="cuda", dtype="bfloat16")
    # fp8 codes crossed PCIe (in bf16 a re-encoded scale may round apart from the checkpoint's: tokens not compared)
    row = QuantLayout.of(ExpertLayout.of(expert_params(experts)), "fp8").nbytes
    assert offloaded.expert_dtype == "fp8" and offloaded.counters["bytes_h2d"]["decode"] == \
        offloaded.counters["copies"]["decode"] * row > 0


def test_a_staged_group_is_dequantized_from_staging_and_only_the_chunks_past_the_buffers_cross_at_its_fetch():
    """``stage`` copies a group's first chunks (one per staging buffer) before its slots are chosen; the fetch of the
    group dequantizes those from staging and copies the rest then. Any other fetch in between drops them: they are
    copied again at theirs."""
    store = _mixed_store("int4")
    store.chunk = 1
    reference = store.params()
    streams = Streams(torch.device("cpu"))
    copies = []
    queue = streams.copy_to_device
    streams.copy_to_device = lambda dst, src, stream: copies.append(src.shape) or queue(dst, src, stream)
    cache = ExpertCache(store.layout, 4, streams)
    experts = [3, 1, 0, 2]  # no two consecutive: a copy each
    cache.stage(experts, store)
    staged = stage_buffers(store.layout)
    assert len(copies) == staged == 3  # the first three, one buffer each
    written = store.packed.clone()
    store.packed.zero_()  # what crosses from here on dequantizes to zeros
    slots = cache.fetch(0, experts, store, "prefill", set())
    for e, slot in zip(experts, slots):
        held = {name: view[slot] for name, view in cache.views.items()}
        expected = reference if e in experts[:staged] else {n: torch.zeros_like(v) for n, v in reference.items()}
        assert all(torch.equal(held[n], expected[n][e]) for n in reference), e
    assert cache.stats.bytes["prefill"] == len(experts) * store.row_bytes  # counted at the fetch, staged ones too
    store.packed.copy_(written)
    cache.stage([0, 1], store)
    cache.fetch(0, [2], store, "prefill", {(0, e) for e in experts[1:]})  # another group: staging is its
    store.packed.zero_()
    slots = cache.fetch(1, [0, 1], store, "prefill", {(0, 2)})
    for slot in slots:  # copied anew
        assert torch.equal(cache.views["down_proj"][slot], torch.zeros_like(reference["down_proj"][0]))


@pytest.mark.parametrize("fmt", ["model", "fp8"])
def test_a_stretch_of_consecutive_experts_into_consecutive_slots_is_one_copy(embedded, fmt):
    """A prefill's group (experts 3, 4, 5 into slots 1, 2, 3) crosses the link in one copy, not one per expert; the
    slots hold what the store holds (dequantized, for a quantized one)."""
    params = {n: p.detach() for n, p in expert_params(find_moe_layers(embedded[0])[0].experts).items()}
    store = make_store(params, fmt, pin=False)
    streams = Streams(torch.device("cpu"))
    copies = []
    queue = streams.copy_to_device
    streams.copy_to_device = lambda dst, src, stream: copies.append((dst.shape, src.shape)) or queue(dst, src, stream)
    cache = ExpertCache(store.layout, 6, streams)
    slots = cache.fetch(0, [3, 4, 5, 9], store, "prefill", set())
    assert slots == [0, 1, 2, 3]  # an empty cache fills in slot order
    # one copy for experts 3-5, one for 9; a quantized store's staging rows 0-3 then go into slots 0-3 in one more
    assert len(copies) == (2 if fmt == "model" else 3)
    assert copies[0][1][0] == 3  # three rows in the first
    expected = torch.empty(16, store.layout.numel, dtype=store.layout.dtype)  # E x P
    for name, value in store.params().items():
        store.layout.views(expected)[name].copy_(value)
    assert torch.equal(cache.buffer[slots], expected[[3, 4, 5, 9]])


def test_a_quantized_default_cache_holds_enough_stored_bytes_for_a_prefill_group():
    """The caching policies' default cache over quantized experts grows (in whole top-k's, at most to twice the
    default) until its slots store QUANTIZED_CACHE_BYTES: Qwen3-30B-A3B-wide fp8 and int4 experts get 32 slots (int4
    capped there), tiny ones double; bf16 and the policies that keep nothing are as before, and so is the count
    pinning leaves to the cache."""
    k, E = 8, 128
    # two experts of Qwen3-30B-A3B's widths (H 2048, I 768): a row's bytes do not depend on E
    params = {"gate_up_proj": torch.randn(2, 2 * 768, 2048) * 0.02, "down_proj": torch.randn(2, 2048, 768) * 0.02}
    stores = {fmt: make_store(params, fmt, pin=False) for fmt in ("model", "fp8", "int4")}
    assert 32 * stores["fp8"].row_bytes >= QUANTIZED_CACHE_BYTES > 32 * stores["int4"].row_bytes
    assert QUANTIZED_CACHE_BYTES > 16 * stores["fp8"].row_bytes
    duoserve, lru, on_demand = POLICIES["duoserve"], POLICIES["lru"], POLICIES["on-demand"]
    assert [default_capacity(duoserve, E, k, 1, stores[f]) for f in ("model", "fp8", "int4")] == [16, 32, 32]
    assert default_capacity(lru, E, k, 1, stores["int4"]) == 32
    assert default_capacity(duoserve, E, k, 2, stores["fp8"]) == 32  # 3k, grown to 4k: 128 MiB
    assert default_capacity(duoserve, E, k, 2, stores["int4"]) == 48  # 3k, grown to twice: 7k would store 128 MiB
    assert default_capacity(on_demand, E, k, 1, stores["int4"]) == k
    assert default_capacity(duoserve, E, k, 1) == 16  # no store: what pinning leaves the cache
    tiny = make_store({"gate_up_proj": torch.randn(2, 64, 64), "down_proj": torch.randn(2, 64, 32)}, "int4", pin=False)
    assert default_capacity(duoserve, E, k, 1, tiny) == 32  # capped at twice the default


def test_an_engine_over_quantized_experts_takes_the_larger_default_cache(embedded):
    """The engine sizes its cache by that rule (the embedded model's experts are tiny: twice the default), and takes
    a budget given as it is."""
    model = copy.deepcopy(embedded[0])
    k = model.config.num_experts_per_tok
    for fmt, slots in (("model", 2 * k), ("int4", 4 * k)):
        stores = offload(model, POLICIES["duoserve"], "cpu", fmt)
        with OffloadEngine(model, stores, POLICIES["duoserve"]) as engine:
            assert engine.cache.slots == slots
        budget = (k + 1) * stores[0].layout.nbytes
        with OffloadEngine(model, stores, POLICIES["duoserve"],
                           settings=EngineSettings(gpu_expert_budget=budget)) as engine:
            assert engine.cache.slots == k + 1
        put_experts(find_moe_layers(model), stores, "cpu")


def test_the_pinning_report_runs_duoserve_with_the_traces_predictor_with_and_without_pins(embedded_trace,
                                                                                          embedded_predictor, tmp_path):
    """benchmarks/runtime_pinning.py on a real trace with a trained predictor: beside lru, duoserve and duoserve + pin,
    the predictor's two rows, whose prefetch copies experts ahead (the others copy none) and whose pinned row holds
    the budget's pins."""
    pinning = load_benchmark("runtime_pinning")
    args = argparse.Namespace(small=True, budgets="25%", prompt_len=16, new_tokens=6, prefetch_min_score=0.0)
    runs = [r for r in pinning.run_trace("embedded", embedded_trace.path, str(embedded_predictor), args,
                                         torch.device("cpu"), tmp_path) if "policy" in r]
    rows = {pinning.who(r): r for r in runs}
    assert list(rows) == ["lru", "duoserve", "duoserve + pin", "duoserve + predictor", "duoserve + predictor + pin"]
    for name, r in rows.items():
        assert r["predicted"] == ("predictor" in name) and r["pinned"] == name.endswith("pin")
        assert (r["prefetched"] > 0) == r["predicted"]
        assert (r["pinned_experts"] > 0) == r["pinned"]
    assert rows["duoserve + pin"]["pinned_experts"] == rows["duoserve + predictor + pin"]["pinned_experts"]
