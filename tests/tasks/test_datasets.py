from __future__ import annotations

import json
import sys

import pytest

from quarl.config import DataConfig
from quarl.tasks import DatasetError, FileTask, build_task, read_examples


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def rows(n):
    return [{"prompt": f"What is {i}+1?", "answer": str(i + 1), "source": "toy"} for i in range(n)]


def test_jsonl_holds_out_the_last_rows_for_eval(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(10))
    task = FileTask(path, num_eval=3)
    train, evals = task.train_examples(), task.eval_examples()
    assert [e.answer for e in train] == [str(i + 1) for i in range(7)]
    assert [e.answer for e in evals] == ["8", "9", "10"]
    assert train[0].meta == {"source": "toy"} and train[0].solution is None
    assert task.reward_spec == "quarl.tasks.rewards:math_reward"
    assert task.reward("so \\boxed{2}", train[1]) == 1.0


def test_separate_eval_file_and_custom_keys(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [{"q": "1+1", "a": 2, "solution": "\\boxed{2}"}])
    evals = write_jsonl(tmp_path / "e.jsonl", [{"q": "2+2", "a": 4.5}, {"q": "3+3", "a": "6"}])
    task = build_task(DataConfig(task="file", path=str(train), eval_path=str(evals), prompt_key="q", answer_key="a"))
    assert [(e.prompt, e.answer, e.solution) for e in task.train_examples()] == [("1+1", "2", "\\boxed{2}")]
    assert [e.answer for e in task.eval_examples()] == ["4.5", "6"]


def test_chat_message_prompts(tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": msgs, "answer": "2"}, {"prompt": "2+2?", "answer": "4"}])
    task = FileTask(path, num_eval=0, system_prompt="Default system.")
    chat, plain = task.train_examples()
    assert task.messages(chat) == msgs  # the example's own system prompt wins
    assert task.messages(plain) == [
        {"role": "system", "content": "Default system."},
        {"role": "user", "content": "2+2?"},
    ]


def test_blank_lines_are_skipped(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [rows(1)[0], "", "  ", rows(2)[1]])
    assert len(read_examples(path)) == 2


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"prompt": "x", "answer": ', "bad JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"prompt": "x", "solution": "y"}', "missing key 'answer' (available keys: 'prompt', 'solution')"),
        ('{"prompt": 3, "answer": "1"}', "'prompt' must be a string or a non-empty list of chat messages"),
        ('{"prompt": [{"role": "bot", "content": "x"}], "answer": "1"}', "role must be one of"),
        ('{"prompt": "x", "answer": [1]}', "'answer' must be a string or a number, got list"),
        ('{"prompt": "x", "answer": "1", "solution": 5}', "'solution' must be a string"),
    ],
)
def test_malformed_line_names_file_line_and_problem(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [rows(1)[0], rows(2)[1], bad_line, rows(4)[3]])
    with pytest.raises(DatasetError) as err:
        read_examples(path)
    assert "bad.jsonl, line 3" in str(err.value) and message in str(err.value)


@pytest.mark.parametrize("bad_line, column, problem", [
    ('{"prompt": "1+1=", "answer": "2"', 33, "Expecting ',' delimiter"),  # the "}" missing: the end of the line
    ('{"prompt": "1+1=", "answer": "2"} x', 35, "Extra data"),
    ('{"prompt": "1+1=", "answer": tru}', 30, "Expecting value"),
])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_bad_json_is_reported_at_its_line_and_column(tmp_path, bad_line, column, problem, newline):
    """Where the line was cut, the error used to be placed after its newline: column 1 of the next line."""
    path = tmp_path / "bad.jsonl"
    path.write_text(newline.join([json.dumps(rows(1)[0]), bad_line, json.dumps(rows(3)[2])]) + newline)
    with pytest.raises(DatasetError) as err:
        read_examples(path)
    assert str(err.value) == f"{path}, line 2: bad JSON ({problem} at column {column})"


def test_a_lone_carriage_return_neither_ends_a_line_nor_shifts_the_next(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a\\rb", "answer": "1"}\n{"prompt":\r "x", "answer": 2\n')
    with pytest.raises(DatasetError, match=r"d.jsonl, line 2: bad JSON \(Expecting ',' delimiter at column 29\)"):
        read_examples(path)


def test_a_byte_that_is_not_utf8_is_reported_at_its_line_and_column(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(rows(1)[0]).encode() + b'\n{"prompt": "\xc3\xa9t\xe9", "answer": "1"}\n')
    with pytest.raises(DatasetError) as err:
        read_examples(path)
    assert str(err.value) == f"{path}, line 2, column 15: not UTF-8 (byte 0xe9); save the file as UTF-8"


def test_missing_key_hint_names_the_config_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "x", "answer": "1"}])
    expected = r"missing key 'prompt' \(available keys: 'question', 'answer'\).*prompt_key"
    with pytest.raises(DatasetError, match=expected):
        read_examples(path)


def test_empty_missing_and_unknown_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match="empty"):
        read_examples(tmp_path / "empty.jsonl")
    with pytest.raises(DatasetError, match="does not exist"):
        read_examples(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="use .jsonl or .parquet"):
        read_examples(tmp_path / "d.csv")


def test_too_few_rows_to_hold_out(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(3))
    with pytest.raises(DatasetError, match="num_eval=3"):
        FileTask(path, num_eval=3)


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = [{"role": "user", "content": "1+1?"}]
    table = pa.Table.from_pylist(
        [{"prompt": "What is 2?", "answer": "2", "id": 1}, {"prompt": None, "answer": "3", "id": 2}]
    )
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match="d.parquet, row 2.*got NoneType"):
        read_examples(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": msgs, "answer": "2", "id": 7}]), tmp_path / "c.parquet")
    (ex,) = read_examples(tmp_path / "c.parquet")
    assert ex.prompt == msgs and ex.answer == "2" and ex.meta == {"id": 7}


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DatasetError, match="pip install pyarrow"):
        read_examples(tmp_path / "d.parquet")
