"""Load a transformers MoE model: from a hub id, a local path or the bundled default, or built from its config.

Tracing, the runtime and the benchmarks all load models here, so they resolve names, devices and
dtypes the same way.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from duoserve.embedded import EMBEDDED_MODEL, EMBEDDED_NAME

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP8_BLOCK = 128  # the block side of the FP8 checkpoints read (and of the runtime's own fp8 experts)


class ModelLoadError(ValueError):
    """The model or its tokenizer could not be loaded."""


def resolve_model(model: str) -> str:
    """The path or hub id to load for ``model`` ('embedded' names the bundled tiny MoE)."""
    return str(EMBEDDED_MODEL) if model == EMBEDDED_NAME else model


def resolve_device(device: str) -> torch.device:
    """'auto' is this rank's GPU (``LOCAL_RANK``) where there is one, else the CPU; refuses a device that is not
    here."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from err
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this machine has no CUDA device (torch {torch.__version__}); "
                             "use --device cpu or auto")
        if chosen.index is not None and chosen.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return chosen


def _local_or_hub(model: str) -> str:
    """``resolve_model``, refusing a path that names no folder (rather than letting the hub try it as an id)."""
    path = resolve_model(model)
    if not Path(path).expanduser().exists() and (path.startswith(("/", ".", "~")) or path.count("/") > 1):
        raise ModelLoadError(f"no model at {path}: that folder does not exist (give a local model folder or a hub id "
                             "such as Qwen/Qwen3-30B-A3B)")
    return path


def config_dtype(dtype: str, device: torch.device) -> str:
    """``dtype`` as a model built from its config takes it on ``device``: 'auto' is bfloat16 on a GPU, float32
    elsewhere."""
    return ("bfloat16" if device.type == "cuda" else "float32") if dtype == "auto" else dtype


def _dtype(dtype: str):
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _config(model: str, revision: str | None = None):
    """``model``'s transformers config, or a ``ModelLoadError`` that says why not."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(_local_or_hub(model), revision=revision)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"could not read a config for {model!r}: {err}") from err


def _experts_format(config, model: str) -> str:
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return "model"
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method, block = quant.get("quant_method"), list(quant.get("weight_block_size") or [])
    if method == "fp8" and block == [FP8_BLOCK, FP8_BLOCK]:
        return "fp8"
    raise ModelLoadError(f"{model} is quantized with {method} (block {block or '-'}); duoserve reads block-wise FP8 "
                         f"checkpoints ({FP8_BLOCK} x {FP8_BLOCK} blocks) and unquantized ones: load the model's "
                         "unquantized checkpoint and store its experts with --expert-dtype fp8 or int4")


def checkpoint_experts(model: str, revision: str | None = None) -> str:
    """How a checkpoint stores its weights, as an expert dtype: "fp8" for a block-wise FP8 checkpoint (the official
    ones, such as Qwen3-30B-A3B-FP8: float8 e4m3 codes and a ``weight_scale_inv`` per 128 x 128 block), else "model".
    Refuses another quantization method, whose loader replaces the experts module with one the engine cannot
    drive."""
    return _experts_format(_config(model, revision), model)


def load_model(model: str, device: str = "auto", dtype: str = "auto", revision: str | None = None):
    """Model (eval mode, on ``device``) and tokenizer (left padding) from a hub id, a local path or 'embedded'.

    A block-wise FP8 checkpoint (``checkpoint_experts``) is loaded dequantized on every device (transformers'
    own FP8 path, which on a GPU would swap in its own experts module): the runtime stores its experts in FP8
    again (``--expert-dtype auto``), which gives back the checkpoint's own codes where its block scales are the
    blocks' absolute maxima over 448, as the official checkpoints' are."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, FineGrainedFP8Config
    from transformers.utils import logging as hf_logging

    torch_dtype = _dtype(dtype)
    path = _local_or_hub(model)
    target = resolve_device(device)
    config = _config(model, revision)  # read once: its quantization decides how to load
    quantized = {"quantization_config": FineGrainedFP8Config(weight_block_size=(FP8_BLOCK, FP8_BLOCK),
                                                             dequantize=True)} \
        if _experts_format(config, model) == "fp8" else {}
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar per shard: the commands draw their own progress
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
        net = AutoModelForCausalLM.from_pretrained(path, config=config, revision=revision, dtype=torch_dtype,
                                                   **quantized)
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"could not load model {model!r}: {err}") from err
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return net.to(target).eval(), tokenizer


def model_from_config(model: str, device: torch.device, dtype: str = "auto", layers: int | None = None):
    """The model (eval mode) built from ``model``'s config with random weights, directly on ``device``; ``layers``
    keeps that many decoder layers. dtype 'auto' is bfloat16 on a GPU, float32 on the CPU."""
    from transformers import AutoModelForCausalLM

    torch_dtype = _dtype(config_dtype(dtype, device))
    config = _config(model)
    if layers:
        text = config.get_text_config()
        text.num_hidden_layers = layers
        if getattr(text, "layer_types", None):
            text.layer_types = text.layer_types[:layers]
    with torch.device(device):
        net = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    return net.eval()


@torch.no_grad()
def model_from_config_experts_on_host(model: str, device: torch.device, dtype: str, layers: int | None = None):
    """``model_from_config`` for a model too large for ``device``: built on the meta device, then initialised one
    module at a time on ``device`` (a GPU draws random numbers far faster than a host, ~0.1 GB/s a core), each MoE
    layer's experts moved to host memory as soon as they are drawn. Peak device memory: the non-expert part and
    one layer's experts. Each module gets transformers' own initialiser, the one ``initialize_weights`` applies
    module by module (norms at one, rotary frequencies recomputed)."""
    from duoserve.discovery import find_moe_layers

    net = model_from_config(model, torch.device("meta"), config_dtype(dtype, device), layers)  # ``device``'s dtype
    experts = {id(layer.experts) for layer in find_moe_layers(net)}
    for module in net.modules():
        if any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))):
            module.to_empty(device=device, recurse=False)
            net._init_weights(module)
            if id(module) in experts:
                module.to("cpu")
    net.tie_weights()
    return net
