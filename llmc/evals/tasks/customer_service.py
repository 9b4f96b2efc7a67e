"""Data for the local lm-eval task: the `choice` items of a business eval set, as lm-eval documents."""
from pathlib import Path

import datasets

from llmc.evals.business_set import load_business_set

REPO_ROOT = Path(__file__).resolve().parents[3]


def load_choice_items(business_set: str, **_metadata) -> datasets.DatasetDict:
    path = Path(business_set)
    items = load_business_set(path if path.is_absolute() or path.exists() else REPO_ROOT / path)
    docs = [
        {
            "policy": next((m["content"] for m in item.messages if m["role"] == "system"), ""),
            "question": item.messages[-1]["content"],
            "choices": item.choices,
            "answer": item.answer_index,
        }
        for item in items
        if item.metric == "choice"
    ]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})
