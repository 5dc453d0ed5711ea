"""Bad input, through the real CLI: exit code 2, one line naming the culprit, no traceback, nothing left behind."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from duoserve.cli.evaluate import app as eval_app
from duoserve.cli.run import app as run_app
from duoserve.cli.trace import app as trace_app
from duoserve.cli.train import app as train_app

APPS = {"trace": trace_app, "train": train_app, "eval": eval_app, "run": run_app}
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")

# (app, arguments, what the message must name); {placeholders} are filled from the workspace below
CASES = [
    ("trace", "collect --count 1 --out {file}/x", "is a file"),
    ("train", "stats {trace} --out {file}/x.safetensors", "is a file"),
    ("train", "fit {trace} --out {file}/p", "is a file"),
    ("eval", "accuracy {trace} --predictor {predictor} --out {file}/r", "is a file"),
    pytest.param("trace", "collect --count 1 --device cuda --out {tmp}/t", "no CUDA device", marks=NO_CUDA),
    pytest.param("train", "fit {trace} --out {tmp}/p --accelerator gpu", "accelerator='gpu'", marks=NO_CUDA),
    pytest.param("train", "stats {trace} --out {tmp}/s.safetensors --device cuda", "no CUDA device", marks=NO_CUDA),
    ("train", "stats {trace} --out {tmp}/s.safetensors --device tpu", "unknown device 'tpu'"),
    ("train", "fit {trace} --out {tmp}/p --devices 0", "devices=0"),
    ("run", "generate --new-tokens 0", "--new-tokens"),
    ("run", "generate --gpu-expert-budget 150%", "give a share in (0, 100]%"),
    ("eval", "simulate --profile h200-embedded --model-shape embedded --gpu-expert-budget 0k --no-charts "
             "--out {tmp}/s", "give at least one top-k"),
    ("run", "generate --new-tokens -1", "--new-tokens"),
    ("trace", "collect --dataset squad --data-files {empty} --count 1 --out {tmp}/t", "empty.jsonl is empty"),
    ("trace", "collect --dataset squad --data-files {bad_json} --count 1 --out {tmp}/t", "bad.jsonl"),
    ("trace", "export {trace} --out {tmp}", "is a folder"),
    ("trace", "collect --model {tmp}/no/such/model --count 1 --out {tmp}/t", "no model at"),
    ("run", "generate --predictor {wrong_weights}", "does not fit config.json"),
    ("train", "fit {trace} --out {tmp}/p --widths abc", "--widths"),
    ("trace", "import {bad_csv} --out {tmp}/i", "bad.csv line 3: layer 'abc'"),
    ("trace", "import {bad_rows} --out {tmp}/i", "rows.jsonl: JSON parse error"),
    pytest.param("run", "generate --device cuda", "no CUDA device", marks=NO_CUDA),
    ("run", "bench --prompt-len 0 --out {tmp}/b.json", "--prompt-len"),
    ("run", "bench --predictor oracle:2 --routing random --out {tmp}/b.json", "oracle:2"),
    ("run", "bench --new-tokens 4 --prompt-len 8 --out {file}/x.json", "is a file"),
    ("run", "profile --model {tmp}/no/such/model --out {tmp}/p.json", "no/such/model"),
    ("run", "profile --model embedded --tokens 0 --out {tmp}/p.json", "--tokens"),
    ("run", "generate --new-tokens 4 --out {file}/x.json", "is a file"),
    ("eval", "accuracy {trace} --predictor {predictor} --out {file}", "is a file"),
    ("eval", "accuracy {trace} --predictor {predictor} --out {busy}", "holds other files"),
    ("eval", "accuracy {trace} --predictor {edited_geometry} --out {tmp}/r", "contradicts its feature spec"),
    ("run", "generate --predictor {edited_geometry}", "contradicts its feature spec"),
    ("trace", "collect --count 1 --lookahead 50 --out {tmp}/t", "look-ahead 50"),
    ("trace", "collect --count 1 --part-rows 0 --out {tmp}/t", "--part-rows"),
    ("eval", "simulate --profile {tmp}/no-profile.json --model-shape embedded --out {tmp}/s", "no device profile"),
    ("eval", "simulate --profile h200-embedded --model-shape qwen3-30b-a3b --out {tmp}/s", "profile it in that"),
    ("eval", "simulate --profile h200-embedded --model-shape embedded --policy accelerate --no-charts "
             "--out {tmp}/s", "does not run the engine's schedule"),
    ("eval", "simulate --profile h200-embedded --model-shape embedded --traces {trace} --predictor oracle:3 "
             "--no-charts --out {tmp}/s", "oracle:3"),
    ("eval", "simulate --profile h100-embedded --model-shape embedded --host-op-us 5 --no-charts --out {tmp}/s",
     "did not record its host's pace"),
]


def _tamper(predictor, folder, edit) -> str:
    shutil.copytree(predictor, folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, embedded_trace, embedded_predictor) -> dict:
    root = tmp_path_factory.mktemp("inputs")
    (root / "file").write_text("not a folder")
    (root / "empty.jsonl").write_text("")
    (root / "bad.jsonl").write_text('{"context": "x", "question"\n')
    (root / "bad.csv").write_text('request_id,token,layer,experts\n0,0,0,"[1, 2]"\n0,0,abc,"[1, 2]"\n')
    (root / "rows.jsonl").write_text('{"request_id": 0, "token": 0, "layer": 0, "experts": [1, 2]}\n{"layer": [\n')
    (root / "busy").mkdir()
    (root / "busy" / "notes.txt").write_text("someone else's")

    def wrong_e(config):  # a config that promises 32 experts to weights of 16
        config["feature_spec"]["num_experts"] = 32
        config["geometry"]["num_experts"] = 32

    return {"root": root, "trace": str(embedded_trace.path), "predictor": str(embedded_predictor),
            "file": str(root / "file"), "empty": str(root / "empty.jsonl"), "bad_json": str(root / "bad.jsonl"),
            "bad_csv": str(root / "bad.csv"),
            "bad_rows": str(root / "rows.jsonl"), "busy": str(root / "busy"),
            "wrong_weights": _tamper(embedded_predictor, root / "wrong-e", wrong_e),
            "edited_geometry": _tamper(embedded_predictor, root / "edited",
                                       lambda config: config["geometry"].update(num_layers=4))}


def _tree(path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


@pytest.mark.parametrize("app, args, culprit", CASES)
def test_bad_input_exits_2_with_one_line_and_leaves_nothing(workspace, tmp_path, app, args, culprit):
    before = _tree(tmp_path), _tree(workspace["root"])
    result = CliRunner().invoke(APPS[app], args.format(tmp=tmp_path, **workspace).split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, (SystemExit, type(None)))
    errors = [line for line in result.output.splitlines() if line.lower().startswith("error:")]
    assert len(errors) == 1 and culprit in errors[0], result.output  # one line, naming what to change
    assert (_tree(tmp_path), _tree(workspace["root"])) == before, "the command left files behind"
