"""Prompt files (JSONL) for benchmarks, speculative evaluation and draft training, read one way for all of them."""
import json
from pathlib import Path

from llmc.core.errors import LlmcError


def first_turn(row: dict) -> str | None:
    """A row's first user turn: MT-bench `turns`, `messages`, or a `prompt`/`text` field."""
    return (row.get("turns") or [None])[0] or (row.get("messages") or [{}])[0].get("content") or row.get("prompt") or row.get("text")


def prompt_rows(path: Path) -> list[dict]:
    """The rows of a JSONL prompt file that hold a first user turn."""
    if not path.is_file():
        raise LlmcError(f"prompt file not found: {path}")
    rows = [row for line in path.read_text().splitlines() if line.strip()
            for row in [json.loads(line)] if isinstance(row, dict) and first_turn(row)]
    if not rows:
        raise LlmcError(f"{path} has no rows with `turns`, `messages`, `prompt` or `text`")
    return rows


def read_prompt_texts(path: Path) -> list[str]:
    """The first user turn of every row of a JSONL file."""
    return [first_turn(row) for row in prompt_rows(path)]


def load_prompts(path: Path, num_prompts: int, tokenizer, chat_template: bool, shared_prefix_tokens: int) -> list[str]:
    """First turns of MT-bench, the first `messages` turn, or the `prompt`/`text` field of any JSONL; reused in order
    to reach num_prompts."""
    texts = read_prompt_texts(path)
    prefix = ""
    if shared_prefix_tokens:
        corpus = tokenizer.encode(" ".join(texts) * (1 + shared_prefix_tokens // 1000), add_special_tokens=False)
        prefix = tokenizer.decode(corpus[:shared_prefix_tokens]) + "\n\n"
    prompts = []
    for index in range(num_prompts):
        text = texts[index % len(texts)]
        if chat_template and tokenizer.chat_template:
            messages = ([{"role": "system", "content": prefix}] if prefix else []) + [{"role": "user", "content": text}]
            prompts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        else:
            prompts.append(prefix + text)
    return prompts


def chat_workload(path: Path, num_prompts: int, tokenizer) -> list[str]:
    """A chat service's requests: each row's `system` prompt (the business set's shared policies), if it has one, and
    first user turn through the chat template, reused in order to reach num_prompts."""
    rows = prompt_rows(path)
    prompts = []
    for index in range(num_prompts):
        row = rows[index % len(rows)]
        messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else [])
        messages.append({"role": "user", "content": first_turn(row)})
        if tokenizer.chat_template:
            prompts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        else:
            prompts.append("\n\n".join(message["content"] for message in messages))
    return prompts


def distinct_prompts(path: Path, num_prompts: int, tokenizer) -> list[str]:
    """The file's first num_prompts prompts through the chat template, each once."""
    return list(dict.fromkeys(load_prompts(path, num_prompts, tokenizer, chat_template=True, shared_prefix_tokens=0)))


def check_not_eval_set(path: Path) -> None:
    first = next((line for line in path.read_text().splitlines() if line.strip()), "{}") if path.is_file() else "{}"
    row = json.loads(first)
    if "question_id" in row and "turns" in row:
        raise LlmcError(f"{path} looks like MT-bench, the evaluation set; train draft heads on other prompts")


def check_prompt_files(files: list[str]) -> None:
    """Every draft-training prompt file readable, with prompts, and none of them the evaluation set."""
    for file in files:
        check_not_eval_set(Path(file))
        read_prompt_texts(Path(file))
