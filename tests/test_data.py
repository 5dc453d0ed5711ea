"""Built-in samples and task datasets: schema, determinism, correct arithmetic, local files, sampling."""

from __future__ import annotations

import json
import operator
import re
from fractions import Fraction

import pandas as pd
import pytest

from duoserve.data import samples
from duoserve.data.tasks import (
    TASKS,
    load_requests,
    load_rows,
    parse_datasets,
    sample_indices,
)

_CHAIN = re.compile(r"((?:\d+ [-+x/] )+\d+) = (\d+)")


def _evaluate_chain(chain: str) -> Fraction:
    tokens = chain.split()
    value = Fraction(int(tokens[0]))
    for op, num in zip(tokens[1::2], tokens[2::2]):
        n = Fraction(int(num))
        value = {"+": operator.add, "-": operator.sub, "x": operator.mul, "/": operator.truediv}[op](value, n)
    return value


def test_squad_rows_schema_spans_and_determinism():
    rows = samples.squad_rows(300, seed=0)
    assert rows == samples.squad_rows(300, seed=0)
    assert rows != samples.squad_rows(300, seed=1)
    assert len({r["id"] for r in rows}) == 300
    for r in rows:
        assert set(r) == {"id", "title", "context", "question", "answers"}
        (text,), (start,) = r["answers"]["text"], r["answers"]["answer_start"]
        assert r["context"][start:start + len(text)] == text
        assert r["question"].endswith("?") and r["title"] in r["context"]
    assert len({r["question"].split()[0] for r in rows}) >= 3  # several kinds of question


def test_orca_math_arithmetic_is_right():
    rows = samples.orca_math_rows(600, seed=3)
    assert rows == samples.orca_math_rows(600, seed=3)
    kinds = set()
    for r in rows:
        assert set(r) == {"question", "answer"}
        steps = _CHAIN.findall(r["answer"])
        assert steps, r["answer"]
        for chain, result in steps:
            assert _evaluate_chain(chain) == int(result), (chain, result, r["answer"])
        final = int(re.search(r"The answer is (\d+)\.$", r["answer"]).group(1))
        assert final == int(steps[-1][1])
        kinds |= {w for w in ("buys", "loose", "equally", "discount", "travels", "years older") if w in r["question"]}
    assert len(kinds) == 6


def test_tasks_differ_and_prompts_end_with_answer_cue():
    squad, orca = TASKS["squad"], TASKS["orca-math"]
    s, o = samples.squad_rows(1)[0], samples.orca_math_rows(1)[0]
    assert squad.prompt(s).startswith("Context: ") and squad.prompt(s).endswith("\nAnswer:")
    assert orca.prompt(o).startswith("Question: ") and orca.prompt(o).endswith("\nAnswer:")


def test_sample_indices_are_seeded_sorted_and_sized():
    a = sample_indices(4000, 0.025, None, seed=0)
    assert len(a) == 100 and list(a) == sorted(set(a))
    assert list(a) == list(sample_indices(4000, 0.025, None, seed=0))
    assert list(a) != list(sample_indices(4000, 0.025, None, seed=1))
    assert len(sample_indices(10, None, 50, 0)) == 10
    assert len(sample_indices(10, 0.01, None, 0)) == 1
    for bad in (dict(fraction=0.0, count=None), dict(fraction=1.2, count=None), dict(fraction=None, count=0),
                dict(fraction=0.1, count=5), dict(fraction=None, count=None)):
        with pytest.raises(ValueError):
            sample_indices(10, seed=0, **bad)


def _write(df: pd.DataFrame, path, fmt: str) -> None:
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in df.to_dict("records")))
    elif fmt == "json":
        path.write_text(json.dumps(df.to_dict("records")))
    elif fmt == "parquet":
        df.to_parquet(path)
    else:
        df.to_csv(path, index=False)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_local_files_in_hub_schema(tmp_path, fmt):
    df = pd.DataFrame({"question": [f"question number {i}?" for i in range(40)],
                       "answer": [f"The answer is {i}." for i in range(40)]})
    path = tmp_path / f"orca.{fmt}"
    _write(df, path, fmt)
    (spec,) = parse_datasets(["orca-math"], [str(path)])
    requests = load_requests(spec, None, 7, seed=5)
    assert [r.request_id for r in requests] == list(sample_indices(40, None, 7, 5))
    for r in requests:  # the request id is the row index in the source split
        assert r.prompt == f"Question: question number {r.request_id}?\nAnswer:"
        assert r.dataset == "orca-math"


def test_local_folder_and_schema_errors(tmp_path):
    folder = tmp_path / "squad"
    folder.mkdir()
    rows = samples.squad_rows(10)
    _write(pd.DataFrame(rows[:5]), folder / "a.jsonl", "jsonl")
    _write(pd.DataFrame(rows[5:]), folder / "b.jsonl", "jsonl")
    (spec,) = parse_datasets(["squad"], [str(folder)])
    assert len(load_rows(spec)) == 10

    bad = tmp_path / "bad.csv"
    _write(pd.DataFrame({"prompt": ["x"]}), bad, "csv")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['context', 'question'\]"):
        load_rows(parse_datasets(["squad"], [str(bad)])[0])
    with pytest.raises(FileNotFoundError, match="data files not found"):
        parse_datasets(["squad"], [str(tmp_path / "missing.json")])
    with pytest.raises(ValueError, match="one path per dataset"):
        parse_datasets(["squad", "orca-math"], [str(bad)])
    with pytest.raises(ValueError, match="takes no --data-files"):
        parse_datasets(["squad-sample"], [str(bad)])
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="one format"):
        parse_datasets(["squad"], [str(tmp_path)])


def test_hub_loading_uses_the_hub_ids_and_explains_failures(monkeypatch):
    import datasets

    calls = []

    def fake_load(path, split=None, **kw):
        calls.append((path, split))
        if path == "rajpurkar/squad":
            raise ConnectionError("offline")
        return datasets.Dataset.from_list(samples.orca_math_rows(20))

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert len(load_requests(parse_datasets(["orca-math"])[0], 0.5, None, 0)) == 10
    with pytest.raises(RuntimeError, match="--data-files PATH.*squad-sample"):
        load_rows(parse_datasets(["squad"])[0])
    assert calls == [("microsoft/orca-math-word-problems-200k", "train"), ("rajpurkar/squad", "train")]
