import json
from pathlib import Path

import pytest

from llmc.core.errors import LlmcError
from llmc.evals.business_set import load_business_set

GOOD = {
    "id": "a",
    "system": "Policy: 30 days.",
    "prompt": "Return window?",
    "reference": "30 days",
    "metric": "contains",
    "tags": ["returns"],
}


def write_lines(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_items_parse_with_system_messages_and_defaults(tmp_path):
    chat = {"messages": [{"role": "user", "content": "hi"}], "references": ["hello", "hey"], "metric": "exact", "max_tokens": 5}
    items = load_business_set(write_lines(tmp_path / "set.jsonl", [GOOD, "", chat]))
    assert [item.id for item in items] == ["a", "line3"]
    assert items[0].messages[0] == {"role": "system", "content": "Policy: 30 days."}
    assert items[1].references == ["hello", "hey"] and items[1].max_tokens == 5 and items[1].tags == []


def test_every_bad_line_is_reported_with_its_number(tmp_path):
    lines = [
        GOOD,
        "{not json",
        GOOD | {"id": "b", "metric": "bleu"},
        GOOD | {"id": "c", "prompt": None},
        {k: v for k, v in GOOD.items() if k != "prompt"} | {"id": "d"},
        GOOD | {"id": "e", "metric": "regex", "reference": "(unclosed"},
        GOOD | {"id": "f", "metric": "choice", "choices": ["x", "y"], "reference": "C"},
        GOOD | {"id": "g", "metric": "json_match", "reference": "{bad"},
        GOOD | {"id": "h", "max_tokens": 0},
        GOOD | {"id": "i", "colour": "red"},
        GOOD,
        GOOD | {"id": "ok"},
    ]
    with pytest.raises(LlmcError) as error:
        load_business_set(write_lines(tmp_path / "set.jsonl", lines))
    message = str(error.value)
    assert "10 bad lines of 12" in message
    for number, text in [(2, "not valid JSON"), (3, "metric: expected one of"), (4, "prompt"), (5, "exactly one of `prompt`"),
                         (6, "bad regular expression"), (7, "neither a choice letter"), (8, "not JSON"),
                         (9, "max_tokens"), (10, "unknown field 'colour'"), (11, "id 'a' is used twice")]:
        assert f"set.jsonl line {number}: " in message and text in message.split(f"line {number}: ")[1].split("\n")[0]
    assert "line 1:" not in message and "line 12:" not in message


def test_missing_and_empty_files_are_errors(tmp_path):
    with pytest.raises(LlmcError, match="cannot read"):
        load_business_set(tmp_path / "none.jsonl")
    with pytest.raises(LlmcError, match="no items"):
        load_business_set(write_lines(tmp_path / "empty.jsonl", [""]))


def test_the_sample_set_is_valid_and_large_enough():
    items = load_business_set(Path(__file__).parents[3] / "calib_data" / "business" / "customer_service.jsonl")
    assert len(items) >= 100
    assert {item.metric for item in items} == {"exact", "contains", "regex", "rouge_l", "json_match", "choice"}
    assert all(item.messages[0]["role"] == "system" for item in items)
