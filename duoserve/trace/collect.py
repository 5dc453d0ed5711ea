"""Collect routing traces: run a model over task prompts (prefill + greedy decode) and record routing.

Shape legend: B requests in a batch, S padded prompt length, C decode forward calls,
L MoE layers, k top-k.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import duoserve
from duoserve.data.tasks import DatasetSpec, Request, load_requests
from duoserve.discovery import MoEGeometry, find_moe_layers, moe_geometry
from duoserve.embedded import EMBEDDED_NAME
from duoserve.files import check_output
from duoserve.loading import load_model
from duoserve.trace.format import TraceMeta, nextgate_column, nextgate_scores_column
from duoserve.trace.hooks import ForwardRecord, RoutingRecorder
from duoserve.trace.writer import TraceWriter, finished_requests, prepare_out_dir


def _eos_ids(model, tokenizer) -> list[int]:
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    return [eos] if isinstance(eos, int) else list(eos or [])


def rows_from_records(records: list[ForwardRecord], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      generated: torch.Tensor, eos_ids: Sequence[int], lookahead: int) -> dict[str, np.ndarray]:
    """Trace rows of one batch, ordered by request, then phase, then position; padding dropped.

    ``records[0]`` is the prefill call (B*S tokens), ``records[1:]`` the decode calls (B tokens
    each); decode call j processes generated token j-1, which is recorded only while its
    sequence has not yet produced EOS (later tokens are padding that no server would compute).
    """
    B, S = input_ids.shape
    if records[0].ids.shape[0] != B * S or any(r.ids.shape[0] != B for r in records[1:]):
        raise RuntimeError(f"unexpected forward calls during generate: token counts "
                           f"{[r.ids.shape[0] for r in records]} for a batch of {B} x {S}")
    mask = attention_mask.bool().cpu()  # B x S
    batch_idx = [torch.arange(B)[:, None].expand(B, S)[mask]]
    phase = [np.zeros(int(mask.sum()), dtype=np.int8)]
    position = [(mask.cumsum(1) - 1)[mask]]
    token = [input_ids.cpu()[mask]]

    def flat(t: torch.Tensor) -> torch.Tensor:  # B x S x L x k -> B x S x L*k
        return t.reshape(B, -1, t.shape[-2] * t.shape[-1])

    depths = [d for d in range(1, lookahead + 1) if d in records[0].nextgate]
    names = ["experts", "scores", *(c for d in depths for c in (nextgate_column(d), nextgate_scores_column(d)))]

    def columns(r: ForwardRecord) -> list[torch.Tensor]:
        return [r.ids, r.weights, *(c for d in depths for c in (r.nextgate[d], r.nextgate_scores[d]))]

    values = [[flat(c)[mask]] for c in columns(records[0])]
    C = len(records) - 1
    if C:
        gen = generated[:, :C].cpu()  # B x C: the input token of each decode call
        is_eos = torch.isin(gen, torch.tensor(list(eos_ids), dtype=gen.dtype))
        live = is_eos.cumsum(1) == 0  # B x C
        batch_idx.append(torch.arange(B)[:, None].expand(B, C)[live])
        phase.append(np.ones(int(live.sum()), dtype=np.int8))
        position.append((mask.sum(1, keepdim=True) + torch.arange(C)[None, :])[live])
        token.append(gen[live])
        for acc, *steps in zip(values, *map(columns, records[1:])):
            acc.append(flat(torch.stack(steps, dim=1))[live])  # B x C x L*k -> rows
    order = np.argsort(torch.cat(batch_idx).numpy(), kind="stable")
    out = {
        "batch_index": torch.cat(batch_idx).numpy()[order],
        "phase": np.array(["prefill", "decode"])[np.concatenate(phase)[order]],
        "position": torch.cat(position).numpy().astype(np.int32)[order],
        "token_id": torch.cat(token).numpy().astype(np.int32)[order],
    }
    for name, acc in zip(names, values):
        col = torch.cat(acc).numpy()[order]
        out[name] = col.astype(np.float16) if name == "scores" else col
    return out


@torch.no_grad()
def trace_batch(model, tokenizer, recorder: RoutingRecorder, requests: Sequence[Request], max_new_tokens: int,
                max_prompt_tokens: int) -> dict[str, np.ndarray]:
    """Run prefill and greedy decode for ``requests`` and return their trace rows."""
    enc = tokenizer([r.prompt for r in requests], return_tensors="pt", padding=True, truncation=True,
                    max_length=max_prompt_tokens).to(model.device)
    with recorder:
        if max_new_tokens > 0:
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=_eos_ids(model, tokenizer))
        else:
            out = enc["input_ids"]
            model(**enc)
    records = recorder.pop()
    generated = out[:, enc["input_ids"].shape[1]:]  # B x G
    rows = rows_from_records(records, enc["input_ids"], enc["attention_mask"], generated,
                             _eos_ids(model, tokenizer), recorder.lookahead)
    b = rows.pop("batch_index")
    rows["request_id"] = np.array([requests[i].request_id for i in b], dtype=np.int64)
    rows["dataset"] = np.array([requests[i].dataset for i in b], dtype=object)
    return rows


@dataclass
class CollectSettings:
    model: str = EMBEDDED_NAME
    datasets: Sequence[DatasetSpec] = ()
    out: Path = Path("traces")
    fraction: float | None = 0.025
    count: int | None = None
    seed: int = 0
    max_new_tokens: int = 32
    max_prompt_tokens: int = 1024
    batch_size: int = 8
    lookahead: int = 1
    nextgate_width: int | None = None  # m next-gate ids and scores kept per token and layer (default 2k)
    device: str = "auto"
    dtype: str = "auto"
    revision: str | None = None
    rows_per_part: int = 200_000  # a part file is written at whichever of these bounds comes first,
    requests_per_part: int = 32  # so a crash loses at most that much work
    seconds_per_part: float = 60.0


@dataclass
class CollectResult:
    out: Path
    geometry: MoEGeometry
    requests: int  # in this rank's share
    resumed: int  # of those, already in the folder
    rows: dict[str, int]  # rows written now, per phase
    seconds: float


def _rank() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def collect(s: CollectSettings, on_batch: Callable[[int, int], None] | None = None) -> CollectResult:
    """Trace ``s.model`` on the sampled prompts of ``s.datasets`` into ``s.out`` (resumable).

    Validates datasets and model before creating anything; ``on_batch(done, total)`` reports progress.
    """
    start = time.time()
    if s.batch_size < 1 or s.max_new_tokens < 0 or s.lookahead < 0 or s.max_prompt_tokens < 1:
        raise ValueError("batch size and max prompt tokens must be >= 1; max new tokens and lookahead >= 0")
    if s.rows_per_part < 1 or s.requests_per_part < 1 or s.seconds_per_part <= 0:
        raise ValueError("rows and requests per part file must be >= 1 and seconds per part file > 0")
    if not s.datasets:
        raise ValueError("no dataset given")
    check_output(s.out, folder=True)
    requests = [r for spec in s.datasets for r in load_requests(spec, s.fraction, s.count, s.seed)]
    model, tokenizer = load_model(s.model, s.device, s.dtype, s.revision)
    layers = find_moe_layers(model, s.model)
    geometry = moe_geometry(model, layers)
    if s.lookahead > geometry.num_layers - 1:
        raise ValueError(f"look-ahead {s.lookahead} reaches past the model's last MoE layer: {s.model} has "
                         f"{geometry.num_layers}, so at most {geometry.num_layers - 1}")
    width = min(s.nextgate_width or 2 * geometry.top_k, geometry.num_experts)
    if not geometry.top_k <= width <= geometry.num_experts:
        raise ValueError(f"next-gate width {width} must be between top-k ({geometry.top_k}) and the expert count "
                         f"({geometry.num_experts})")
    recorder = RoutingRecorder(layers, geometry.top_k, s.lookahead, width)
    meta = TraceMeta(
        model=s.model, revision=s.revision, num_layers=geometry.num_layers, num_experts=geometry.num_experts,
        top_k=geometry.top_k, decoder_indices=list(geometry.decoder_indices),
        datasets=[{"name": d.name, "source": d.source} for d in s.datasets], lookahead=s.lookahead,
        nextgate_width=width if s.lookahead else 0, fraction=s.fraction, count=s.count, seed=s.seed, package_version=duoserve.__version__,
        generation={"max_new_tokens": s.max_new_tokens, "max_prompt_tokens": s.max_prompt_tokens, "greedy": True,
                    "dtype": s.dtype},
    )
    run = {k: v for k, v in asdict(meta).items() if k != "package_version"}
    rank, world = _rank()
    prepare_out_dir(s.out, run, rank)
    share = requests[rank::world]
    done = finished_requests(s.out)
    todo = [r for r in share if (r.dataset, r.request_id) not in done]
    lengths = [len(ids) for ids in tokenizer([r.prompt for r in todo])["input_ids"]] if todo else []
    todo = [todo[i] for i in np.argsort(lengths, kind="stable")[::-1]]  # long first: less padding, early OOM

    writer = TraceWriter(s.out, meta, rank, s.rows_per_part, s.requests_per_part, s.seconds_per_part)
    rows = {"prefill": 0, "decode": 0}
    for i in range(0, len(todo), s.batch_size):
        batch = todo[i:i + s.batch_size]
        cols = trace_batch(model, tokenizer, recorder, batch, s.max_new_tokens, s.max_prompt_tokens)
        writer.add(cols)
        for phase in rows:
            rows[phase] += int((cols["phase"] == phase).sum())
        if on_batch:
            on_batch(i + len(batch), len(todo))
    writer.flush()
    return CollectResult(s.out, geometry, len(share), len(share) - len(todo), rows, time.time() - start)
