"""Offload policies side by side on one model (``duoserve-run bench``): latency, memory, bytes, and their bounds.

Shape legend: B sequences, S prompt length, N new tokens.

Each policy runs the same random prompts with the same routing. The model may be config-only
(random weights, built on the device); then its routers are degenerate and ``routing`` should be
``random`` or a trace to replay (``drivers.py``). Bounds and targets: ``targets.py``.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import psutil
import torch

import duoserve
from duoserve.bench.drivers import (
    OraclePredictor,
    RandomRouting,
    ReplayRouting,
    is_artifact,
    oracle_recall,
)
from duoserve.bench.targets import GB, add_bounds, check_targets
from duoserve.discovery import find_moe_layers, moe_geometry
from duoserve.loading import (
    config_dtype,
    load_model,
    model_from_config,
    model_from_config_experts_on_host,
    resolve_device,
)
from duoserve.predictor.artifact import load_predictor
from duoserve.predictor.model import ExpertPredictor
from duoserve.runtime.generation import cache_for, offload_plugin, timed_generate
from duoserve.runtime.plugin import ExpertsPlugin
from duoserve.runtime.policies import DEFAULT_POLICIES, Policy, get_policy
from duoserve.runtime.settings import EngineSettings
from duoserve.runtime.quant import EXPERT_DTYPES, check_expert_dtype, make_store, stored_nbytes
from duoserve.runtime.store import ExpertLayout, HostExperts, drop_experts, expert_params, put_experts, take_experts


@dataclass
class BenchSettings:
    model: str
    config_only: bool = False
    layers: int | None = None  # config-only: keep this many decoder layers
    dtype: str = "auto"
    device: str = "auto"
    policies: list[str] = field(default_factory=lambda: list(DEFAULT_POLICIES))
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    prompt_lens: list[int] = field(default_factory=lambda: [512])
    grid: str = "product"  # product: every (batch size, prompt length); axes: each varied at the other's first
    new_tokens: int = 128
    baseline_new_tokens: int | None = None  # fewer tokens for the fetch-bound baselines
    routing: str = "router"  # router, random, or a trace folder to replay
    predictors: list[str] = field(default_factory=lambda: ["none"])  # none, oracle[:recall], or an artifact
    engine: EngineSettings = EngineSettings()  # the offload policies' cache budget, look-ahead, graphs, threshold
    expert_dtypes: list[str] = field(default_factory=lambda: ["model"])  # host experts' formats (packed policies)
    seed: int = 0
    repeats: int = 1  # rounds over every configuration, interleaved, so drift and order show

    def __post_init__(self):
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")
        if self.layers and not self.config_only:
            raise ValueError("--layers needs --config-only (a trained model keeps its layers)")
        for fmt in self.expert_dtypes:
            check_expert_dtype(fmt)
        if self.grid not in ("product", "axes"):
            raise ValueError(f"grid must be product or axes, got {self.grid!r}")

    def shapes(self) -> list[tuple[int, int]]:
        """The (batch size, prompt length) pairs the bench runs, in order."""
        if self.grid == "product":
            return [(b, S) for S in self.prompt_lens for b in self.batch_sizes]
        S0, B0 = self.prompt_lens[0], self.batch_sizes[0]
        return [(b, S0) for b in self.batch_sizes] + [(B0, S) for S in self.prompt_lens[1:]]

    def run_count(self) -> int:
        """Timed runs of a bench with these settings (untimed warm-ups aside)."""
        return self.repeats * len(self.shapes()) * sum(
            (len(self.predictors) if p == "duoserve" else 1) * len(self.dtypes_of(get_policy(p)))
            for p in self.policies)

    def dtypes_of(self, policy: Policy) -> list[str]:
        """The expert dtypes ``policy`` runs: every one asked for where it reads packed stores, else the model's."""
        return self.expert_dtypes if policy.quantizable else ["model"]


def build_model(s: BenchSettings, device: torch.device, free_bytes: int | None = None,
                say: Callable[[str], None] = lambda _: None):
    """The model (eval mode) with all weights: config-only (random init) on ``device``, or with its experts in host
    memory where its weights would not fit the device's free memory (``free_bytes``, default: measured now), as a
    full-depth Mixtral-8x7B (93 GB) on an 80 GB card. A checkpoint loads on the CPU."""
    if not s.config_only:
        return load_model(s.model, device="cpu", dtype=s.dtype)[0]
    dtype = config_dtype(s.dtype, device)  # the meta build below measures the model in the device's dtype
    if device.type == "cuda":
        meta = model_from_config(s.model, torch.device("meta"), dtype, s.layers)  # the geometry, no memory
        need = sum(p.numel() * p.element_size() for p in meta.parameters())
        free = torch.cuda.mem_get_info(device)[0] if free_bytes is None else free_bytes
        if need > 0.9 * free:  # headroom for the cache, activations and the CUDA context
            say(f"the model's {need / GB:.1f} GB do not fit the device's {free / GB:.1f} GB free: initialising it a "
                "module at a time, its experts kept in host memory")
            return model_from_config_experts_on_host(s.model, device, dtype, s.layers)
    return model_from_config(s.model, device, dtype, s.layers)


def copy_bandwidth(device: torch.device, nbytes: int, trials: int = 3) -> dict[str, float | None]:
    """Host-to-device GB/s from pinned and pageable memory (on the CPU: memcpy, as 'pageable'): copies of
    ``nbytes`` (one expert) back to back, 1 GB a trial on CUDA, the best of ``trials`` (the bounds use it)."""
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    total = 1 << 30 if device.type == "cuda" else 1 << 26  # the CPU stand-in only needs a figure
    repeats = max(2, -(-total // nbytes))
    result = {}
    for kind in ("pinned", "pageable"):
        if kind == "pinned" and device.type != "cuda":
            result["pinned_gbps"] = None
            continue
        src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")
        dst.copy_(src)
        best = float("inf")
        for _ in range(trials):
            sync(device)
            start = time.perf_counter()
            for _ in range(repeats):
                dst.copy_(src, non_blocking=kind == "pinned")
            sync(device)
            best = min(best, time.perf_counter() - start)
        result[f"{kind}_gbps"] = nbytes * repeats / best / GB
    return result


def host_op_us(device: torch.device, ops: int = 500) -> float:
    """Host microseconds per small tensor op (dispatch and launch) right now: the unit a host-bound decode step is
    made of. On shared machines it drifts between runs; each run records it next to its timings."""
    x = torch.zeros(1, device=device)
    sync(device)
    start = time.perf_counter()
    for _ in range(ops):
        x.add_(1)
    sync(device)
    return (time.perf_counter() - start) / ops * 1e6


def sync(device: torch.device) -> None:
    """Wait for the device (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _routing(s: BenchSettings, L: int, E: int, k: int, device: torch.device, in_graph: bool = False):
    if s.routing == "router":
        return None
    if s.routing == "random":
        return RandomRouting(L, E, k, seed=s.seed, device=device, in_graph=in_graph)
    return ReplayRouting(s.routing, L, E, k)


def _load_predictors(specs: list[str], routing: str) -> dict[str, ExpertPredictor]:
    """The trained artifacts among ``specs``, read once (on the CPU); refuses a spec that cannot run, before a
    large model is built."""
    for spec in (s for s in specs if s.startswith("oracle")):
        oracle_recall(spec)
    if routing == "router" and any(spec.startswith("oracle") for spec in specs):
        raise ValueError("an oracle predictor needs --routing random or a trace (it must know the routing)")
    return {spec: load_predictor(spec) for spec in specs if is_artifact(spec)}


def _predictor(spec: str, routing, L: int, E: int, device: torch.device, loaded: dict[str, ExpertPredictor]):
    if spec == "none":
        return None
    if spec.startswith("oracle"):
        return OraclePredictor(routing, L, E, oracle_recall(spec))
    return loaded[spec] if spec in loaded else load_predictor(spec, device)


def run_policy(model, stores: dict[str, list[HostExperts]], policy: Policy, predictor: str, s: BenchSettings,
               input_ids: torch.Tensor, new_tokens: int, loaded: dict[str, ExpertPredictor] | None = None,
               expert_dtype: str = "model") -> dict:
    """One timed generation of ``policy`` (after a short warm-up) on experts stored in ``expert_dtype``, with the
    engine's counters. ``stores``: by expert dtype, and "modules" for the per-module policies. ``loaded``: trained
    predictors already read, by spec (others are read here)."""
    device = input_ids.device
    layers = find_moe_layers(model)
    g = moe_geometry(model, layers)
    routing = _routing(s, g.num_layers, g.num_experts, g.top_k, device, in_graph=policy.compiled)
    mask = torch.ones_like(input_ids)
    if policy.resident:  # the form put back: a quantized one computes its dequantized weights
        form = _resident_form(stores)
        expert_dtype = form if form in EXPERT_DTYPES else "model"
        put_experts(layers, stores[form], device)
        plugin = ExpertsPlugin(model, routing)
    else:
        deployed = _predictor(predictor, routing, g.num_layers, g.num_experts, device, loaded or {})
        plugin = offload_plugin(model, stores[expert_dtype if policy.pinned else "modules"], policy, deployed,
                                routing, s.engine, device)
    # an engine's step graphs are captured on the warm-up's static cache (its second decode step) and replayed after
    cache = cache_for(plugin, model, input_ids.shape[1] + max(new_tokens, 3))
    try:
        with plugin:
            # warm-up at full size: kernel loading, cuBLAS, allocator; a compiled decode step is compiled for its
            # static cache's length, so its warm-up generates as many tokens as the timed run
            timed_generate(model, input_ids, mask, new_tokens if policy.compiled else 2 + (cache is not None),
                           fixed_length=True, static_cache=policy.compiled, cache=cache)
            if not policy.resident:
                plugin.reset_stats()
            gc.collect()
            # the host's pace on both sides of the timed generation: it drifts within a run, and a sample before it
            # alone can miss that (on an H200, 7.7 us an op, among its bench's fastest, before the slower int4 round)
            paces = [host_op_us(device)]
            _, timing = timed_generate(model, input_ids, mask, new_tokens, fixed_length=True,
                                       static_cache=policy.compiled, cache=cache)
            paces.append(host_op_us(device))
            counters = {} if policy.resident else plugin.stats()
    finally:
        if policy.resident:
            drop_experts(layers)
        if policy.compiled:  # the compiled step and its CUDA graphs' memory pool go with the run
            model.__dict__.pop("_compiled_call", None)
            torch.compiler.reset()
        del plugin, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"policy": policy.name, "predictor": predictor if policy.predict else None, "expert_dtype": expert_dtype,
            "dtype_fixed": not policy.quantizable, "resident": policy.resident,
            "batch_size": len(input_ids), "prompt_len": input_ids.shape[1], "host_op_us": statistics.fmean(paces),
            "host_op_us_samples": paces,
            **timing, **counters}


def prepare(s: BenchSettings, policies: list[Policy], device: torch.device,
            say: Callable[[str], None]) -> tuple[torch.nn.Module, dict[str, list[HostExperts]], dict]:
    """The model on ``device`` with its experts taken off into the host stores ``policies`` read (``run_policy``'s
    ``stores``: by expert dtype, "modules" for the per-module policies), and the copy bandwidth of one expert.

    Only the stores some policy reads are made, each straight from the model's parameters a layer at a time, so a
    full-depth model keeps one host copy per form: no model-dtype copy beside quantized ones unless a policy
    runs it, and the per-module copy pinned when Accelerate's pinned offload is its only reader (Accelerate then
    uses it as its state dict, no second copy). The resident policies put back whichever store there is."""
    model = build_model(s, device, say=say)
    layers = find_moe_layers(model)
    pin = device.type == "cuda"
    packed = {f for p in policies if p.pinned and not p.resident for f in s.dtypes_of(p)}  # cpu-experts: "model"
    readers = [p for p in policies if not p.pinned]
    if not packed and not readers:  # resident policies only: a store to put the experts back from
        packed = {"model"}
    pin_modules = pin and bool(readers) and all(p.accelerate == "pinned" for p in readers)
    quantized = sorted(packed - {"model"})
    repin = pin and not pin_modules and any(p.accelerate == "pinned" for p in readers)  # Accelerate pins its own
    forms = [*quantized, *(["model"] if "model" in packed else []), *(["modules"] * (1 + repin) if readers else [])]
    on_host = next(iter(expert_params(layers[0].experts).values())).device.type == "cpu"
    _check_host_memory(layers, forms, freed=on_host)
    if quantized:
        say(f"quantizing the experts to {', '.join(quantized)}")

    def make(params: dict[str, torch.Tensor]) -> dict[str, HostExperts]:
        forms = {fmt: make_store({n: p.to(device) for n, p in params.items()}, fmt, pin) for fmt in quantized}
        if "model" in packed:
            forms["model"] = HostExperts.pack(params, pin)
        if readers:
            forms["modules"] = HostExperts.as_modules(params, pin_modules)
        return forms

    per_layer = take_experts(layers, make)
    stores = {form: [layer[form] for layer in per_layer] for form in per_layer[0]}
    bandwidth = copy_bandwidth(device, stores[_resident_form(stores)][0].layout.nbytes)
    model.to(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    gc.collect()
    gc.freeze()  # the model's many objects: out of the collector's way during timed runs
    return model, stores, bandwidth


def _check_host_memory(layers: list, forms: list[str], freed: bool) -> None:
    """Refuse, before any store is made, a bench whose host stores would not fit in the memory available now
    (``freed``: the model's experts are in host memory already and leave it as the stores are made)."""
    layout = ExpertLayout.of(expert_params(layers[0].experts))
    per_expert = {f: stored_nbytes(layout, f if f in EXPERT_DTYPES else "model") for f in forms}
    experts = sum(layer.experts.num_experts for layer in layers)
    need = sum(per_expert[f] for f in forms) * experts
    available = psutil.virtual_memory().available + (layout.nbytes * experts if freed else 0)
    if need > available:
        raise ValueError(f"the expert stores these policies read ({', '.join(forms)}) need {need / GB:.1f} GB of "
                         f"host memory and {available / GB:.1f} GB is available: run the policies that read "
                         f"different stores in separate benches, or store the experts quantized (--expert-dtype)")


def _resident_form(stores: dict[str, list[HostExperts]]) -> str:
    """The store the resident policies put back: the model's dtype where kept, else per module, else the first
    quantized form (put back dequantized)."""
    return next(f for f in ("model", "modules", *sorted(stores)) if f in stores)


def bench(s: BenchSettings, on_run: Callable[[dict, dict], None] | None = None,
          on_status: Callable[[str], None] | None = None) -> dict:
    """Run every (shape, policy, predictor) of ``s``; the results as one JSON-ready dict. ``on_run`` gets each timed
    run's result and the report of every run so far (``"complete": False`` until the last; a caller that writes
    it keeps what a long bench measured if it is stopped), ``on_status`` a line saying what runs next (untimed
    warm-ups included)."""
    say = on_status or (lambda text: None)
    policies = [get_policy(p) for p in s.policies]
    loaded = _load_predictors(s.predictors, s.routing)
    # the routers' guesses come from this run's hidden states, whose routing is not the one forced on it
    notes = [f"{spec} reads the next-gate, computed on this run's prompts: with --routing {s.routing} its guesses are "
             "not the ones it would make on the routing forced here (compare a next-gate predictor with "
             "--routing router, or fit --family paper)" for spec, p in loaded.items()
             if p.spec.uses_nextgate and s.routing != "router"]
    device = resolve_device(s.device)
    model, stores, bandwidth = prepare(s, policies, device, say)
    layers = find_moe_layers(model)
    geometry = moe_geometry(model, layers)
    layout = stores[_resident_form(stores)][0].layout
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    policies, skipped = fitting(policies, geometry.num_layers * geometry.num_experts * layout.nbytes, free)
    for note in skipped:
        say(f"skipped {note['policy']}: {note['reason']}")
    if not policies:
        raise ValueError(f"no policy fits this device: {'; '.join(n['reason'] for n in skipped)}")
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(s.seed)
    runs = []

    def report(complete: bool) -> dict:
        add_bounds(runs, bandwidth["pinned_gbps"], bandwidth["pageable_gbps"])
        return {
            "duoserve": duoserve.__version__, "torch": torch.__version__, "device": device_name(device),
            "model": s.model, "config_only": s.config_only, "dtype": str(layout.dtype),
            "geometry": {"moe_layers": geometry.num_layers, "experts": geometry.num_experts, "top_k": geometry.top_k,
                         "expert_mb": layout.nbytes / 1e6,
                         "stored_expert_mb": {f: stores[f][0].row_bytes / 1e6 for f in s.expert_dtypes
                                              if stores.get(f)}},
            "routing": s.routing, "prompt_lens": s.prompt_lens, "grid": s.grid, "new_tokens": s.new_tokens,
            "baseline_new_tokens": s.baseline_new_tokens,
            **{k: v for k, v in asdict(s.engine).items() if k != "pin"}, "pin_keys": len(s.engine.pin),
            "bandwidth": bandwidth, "complete": complete, "skipped": skipped, "notes": notes, "runs": runs,
            "targets": check_targets(runs),
        }

    # all-resident first: its experts go on and off the device before any offload run is timed
    order = sorted(policies, key=lambda p: (not p.resident, p.compiled))  # a compiled run never warms the rest
    warm = [order[0]] + [p for p in order if not p.resident][:1 if order[0].resident else 0]
    warm = [p for p in warm if not p.compiled]  # its own run compiles and warms up first (run_policy)
    for batch, prompt_len in s.shapes():
        input_ids = torch.randint(vocab, (batch, prompt_len), generator=generator).to(device)
        # untimed: a process's first offload run, and the first run at a new shape (all-resident too), pay
        # kernel loading and allocator growth that later runs do not
        for policy in warm:
            say(f"warm-up {policy.name} B={batch} S={prompt_len} (untimed)")
            run_policy(model, stores, policy, s.predictors[0] if policy.predict else "none", s, input_ids,
                       _new_tokens(s, policy), loaded, s.dtypes_of(policy)[0])
        for round_ in range(s.repeats):
            for policy, fmt, predictor in ((p, f, q) for p in order for f in s.dtypes_of(p)
                                           for q in (s.predictors if p.predict else ["none"])):
                say(f"{policy.name}{'' if predictor == 'none' else ' ' + predictor}"
                    f"{'' if fmt == 'model' else ' ' + fmt} B={batch} S={prompt_len}")
                run = run_policy(model, stores, policy, predictor, s, input_ids, _new_tokens(s, policy), loaded, fmt)
                run["round"] = round_
                # config-only models may keep fewer layers than the real one: per-layer figures scale
                run["per_moe_layer"] = {"ttft_s": run["ttft_s"] / geometry.num_layers,
                                        "tpot_ms": run["tpot_ms"] / geometry.num_layers if run["tpot_ms"] else None}
                runs.append(run)
                if on_run:
                    on_run(run, report(complete=False))
    return report(complete=True)


RESIDENT_MARGIN = 2 << 30  # bytes a resident run needs beside its experts: KV cache, activations, a compiled step


def fitting(policies: list[Policy], expert_bytes: int, free_bytes: int | None) -> tuple[list[Policy], list[dict]]:
    """The policies that can run, and a note for each resident one whose ``expert_bytes`` (every expert on the
    device, in the model's dtype) and ``RESIDENT_MARGIN`` exceed the device's ``free_bytes`` (None: unknown, as on
    the CPU: all run): a full-depth Mixtral's 90 GB on an 80 GB card is reported, not an out-of-memory crash."""
    if free_bytes is None:
        return policies, []
    kept, skipped = [], []
    for p in policies:
        if p.resident and expert_bytes + RESIDENT_MARGIN > free_bytes:
            skipped.append({"policy": p.name, "reason": f"every expert resident needs {expert_bytes / GB:.1f} GB "
                                                        f"and ~{RESIDENT_MARGIN / GB:.1f} GB beside them; the device "
                                                        f"has {free_bytes / GB:.1f} GB free"})
        else:
            kept.append(p)
    return kept, skipped


def _new_tokens(s: BenchSettings, policy: Policy) -> int:
    """Tokens a run generates: fewer for the fetch-bound baselines when ``baseline_new_tokens`` is set."""
    slow = not (policy.predict or policy.resident)
    return s.baseline_new_tokens if slow and s.baseline_new_tokens else s.new_tokens


def device_name(device: torch.device) -> str:
    """The GPU's name, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
