"""The business eval format: JSONL, one item a line, read with errors that name the line and the field."""
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from llmc.core.errors import LlmcError

METRICS = ("exact", "contains", "regex", "rouge_l", "json_match", "choice")
FIELDS = {"id", "prompt", "messages", "reference", "references", "choices", "metric", "tags", "max_tokens", "system"}
DEFAULT_MAX_TOKENS = 32
CHOICE_LABELS = "ABCDEFGHIJ"


@dataclass
class BusinessItem:
    id: str
    messages: list[dict]
    references: list
    metric: str
    tags: list[str] = field(default_factory=list)
    max_tokens: int = DEFAULT_MAX_TOKENS
    choices: list[str] = field(default_factory=list)

    @property
    def prompt_messages(self) -> list[dict]:
        """The chat sent to the model: for `choice` items, the options are listed after the question."""
        if not self.choices:
            return self.messages
        options = "\n".join(f"- {choice}" for choice in self.choices)
        question = f"{self.messages[-1]['content']}\nOptions:\n{options}\nAnswer with the correct option."
        return [*self.messages[:-1], {"role": "user", "content": question}]

    @property
    def answer_index(self) -> int:
        """For `choice` items: the index of the correct choice."""
        return self.references[0]

    @property
    def reference_text(self) -> str:
        """The continuation a perfect answer starts with (used for the KL measurement)."""
        if self.metric == "choice":
            return self.choices[self.answer_index]
        reference = self.references[0]
        return reference if isinstance(reference, str) else json.dumps(reference)


def load_business_set(path: Path) -> list[BusinessItem]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise LlmcError(f"cannot read business eval set {path}: {error.strerror}") from None
    items, errors, seen = [], [], set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = parse_item(line, default_id=f"line{number}")
            if item.id in seen:
                raise ValueError(f"id {item.id!r} is used twice")
            seen.add(item.id)
            items.append(item)
        except ValueError as error:
            errors.append(f"  {Path(path).name} line {number}: {error}")
    if errors:
        raise LlmcError(f"invalid business eval set {path} ({len(errors)} bad lines of {len(lines)}):\n" + "\n".join(errors))
    if not items:
        raise LlmcError(f"business eval set {path} has no items")
    return items


def parse_item(line: str, default_id: str) -> BusinessItem:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(raw, dict):
        raise ValueError("an item is a JSON object")
    unknown = sorted(set(raw) - FIELDS)
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} (fields: {', '.join(sorted(FIELDS))})")
    metric = raw.get("metric")
    if metric not in METRICS:
        raise ValueError(f"metric: expected one of {', '.join(METRICS)}, got {metric!r}")
    choices = _string_list(raw, "choices") if "choices" in raw else []
    if (metric == "choice") != bool(choices):
        raise ValueError("choices: required (at least two) for metric `choice`, and only for it")
    references = _references(raw, metric, choices)
    max_tokens = raw.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens: expected a positive integer, got {max_tokens!r}")
    return BusinessItem(
        id=str(raw.get("id", default_id)),
        messages=_messages(raw),
        references=references,
        metric=metric,
        tags=_string_list(raw, "tags") if "tags" in raw else [],
        max_tokens=max_tokens,
        choices=choices,
    )


def _messages(raw: dict) -> list[dict]:
    if ("prompt" in raw) == ("messages" in raw):
        raise ValueError("give exactly one of `prompt` (a string) or `messages` (a chat)")
    if "prompt" in raw:
        if not isinstance(raw["prompt"], str) or not raw["prompt"].strip():
            raise ValueError("prompt: expected a non-empty string")
        messages = [{"role": "user", "content": raw["prompt"]}]
    else:
        messages = raw["messages"]
        valid = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
            for m in messages
        )
        if not valid or messages[-1]["role"] != "user":
            raise ValueError("messages: expected a list of {role: system|user|assistant, content: str} ending with a user turn")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if "system" in raw:
        if not isinstance(raw["system"], str):
            raise ValueError("system: expected a string")
        if messages[0]["role"] == "system":
            raise ValueError("system: the messages already start with a system turn")
        messages = [{"role": "system", "content": raw["system"]}, *messages]
    return messages


def _references(raw: dict, metric: str, choices: list[str]) -> list:
    if ("reference" in raw) == ("references" in raw):
        raise ValueError("give exactly one of `reference` or `references` (a list)")
    references = [raw["reference"]] if "reference" in raw else raw["references"]
    if not isinstance(references, list) or not references:
        raise ValueError("references: expected a non-empty list")
    if metric == "json_match":
        return [_json_value(reference) for reference in references]
    if not all(isinstance(reference, str) and reference.strip() for reference in references):
        raise ValueError(f"reference: expected non-empty strings for metric `{metric}`")
    if metric == "regex":
        for pattern in references:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"reference: bad regular expression {pattern!r}: {error}") from None
    if metric == "choice":
        if len(references) != 1:
            raise ValueError("reference: a `choice` item has exactly one correct choice")
        return [_choice_index(references[0], choices)]
    return references


def _choice_index(reference: str, choices: list[str]) -> int:
    labels = CHOICE_LABELS[: len(choices)]
    if reference.strip().upper() in labels:
        return labels.index(reference.strip().upper())
    if reference in choices:
        return choices.index(reference)
    raise ValueError(f"reference: {reference!r} is neither a choice letter ({', '.join(labels)}) nor one of the choices")


def _json_value(reference):
    if not isinstance(reference, str):
        return reference
    try:
        return json.loads(reference)
    except json.JSONDecodeError:
        raise ValueError(f"reference: {reference!r} is not JSON (json_match compares parsed JSON)") from None


def _string_list(raw: dict, name: str) -> list[str]:
    value = raw[name]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{name}: expected a list of non-empty strings")
    if name == "choices" and not 2 <= len(value) <= len(CHOICE_LABELS):
        raise ValueError(f"choices: expected 2 to {len(CHOICE_LABELS)} options")
    return value
