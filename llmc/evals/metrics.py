"""Scoring one generated answer against an item's references; every metric gives a score in [0, 1]."""
import json
import re
import string

from llmc.evals.business_set import BusinessItem

_PUNCTUATION = string.punctuation + "“”‘’"
_JSON_BLOCK = re.compile(r"\{.*\}|\[.*\]", re.DOTALL)


def normalize(text: str) -> str:
    return " ".join(text.casefold().split()).strip(_PUNCTUATION + " ")


def exact(output: str, references: list[str]) -> float:
    return float(normalize(output) in {normalize(reference) for reference in references})


def contains(output: str, references: list[str]) -> float:
    return float(any(normalize(reference) in normalize(output) for reference in references))


def regex(output: str, patterns: list[str]) -> float:
    return float(any(re.search(pattern, output, re.IGNORECASE) for pattern in patterns))


def rouge_l(output: str, references: list[str]) -> float:
    """ROUGE-L F1 on lowercased words: the longest common subsequence against the best reference."""
    candidate = _words(output)
    return max(_lcs_f1(candidate, _words(reference)) for reference in references)


def json_match(output: str, references: list) -> float:
    """1 for JSON equal to a reference; for object references, the share of its keys the output matches."""
    parsed = parse_json(output)
    best = 0.0
    for reference in references:
        if parsed == reference:
            return 1.0
        if isinstance(reference, dict) and isinstance(parsed, dict) and reference:
            best = max(best, sum(parsed.get(key) == value for key, value in reference.items()) / len(reference))
    return best


def parse_json(output: str):
    match = _JSON_BLOCK.search(output)
    if match is None:
        return None
    try:
        return json.loads(match.group(0))
    except json.JSONDecodeError:
        return None


def score(item: BusinessItem, output: str) -> float:
    """A generated answer's score; `choice` items are scored by which option the model finds likeliest."""
    return SCORERS[item.metric](output, item.references)


SCORERS = {"exact": exact, "contains": contains, "regex": regex, "rouge_l": rouge_l, "json_match": json_match}


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.casefold())


def _lcs_f1(candidate: list[str], reference: list[str]) -> float:
    if not candidate or not reference:
        return 0.0
    previous = [0] * (len(reference) + 1)
    for word in candidate:
        current = [0]
        for j, other in enumerate(reference):
            current.append(previous[j] + 1 if word == other else max(previous[j + 1], current[j]))
        previous = current
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)
