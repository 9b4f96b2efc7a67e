"""Running a business eval set on one model, and comparing a quantized model's answers with the base's."""
from dataclasses import asdict, dataclass

from tqdm import tqdm

from llmc.evals.business_set import BusinessItem
from llmc.evals.generation import GenerationRequest, Generator
from llmc.evals.metrics import score

BATCH_SIZE = 8


@dataclass
class ItemResult:
    id: str
    tags: list[str]
    metric: str
    output: str
    score: float


@dataclass
class BusinessResult:
    items: list[ItemResult]

    @property
    def score(self) -> float:
        return mean(item.score for item in self.items)

    def tag_scores(self) -> dict[str, float]:
        tags = sorted({tag for item in self.items for tag in item.tags})
        return {tag: mean(item.score for item in self.items if tag in item.tags) for tag in tags}

    def to_dict(self) -> dict:
        return {"score": self.score, "tags": self.tag_scores(), "items": [asdict(item) for item in self.items]}


def run_business(generator: Generator, items: list[BusinessItem], label: str = "business") -> BusinessResult:
    """Choice items pick an option; the rest generate, batched by similar `max_tokens` so that short
    answers do not wait for long ones."""
    results: dict[str, ItemResult] = {}
    for item in tqdm([item for item in items if item.metric == "choice"], desc=f"{label} (choice)", unit="item"):
        chosen = generator.choose(item.prompt_messages, item.choices)
        results[item.id] = ItemResult(item.id, item.tags, item.metric, item.choices[chosen], float(chosen == item.answer_index))
    generated = sorted((item for item in items if item.metric != "choice"), key=lambda item: item.max_tokens)
    for start in tqdm(range(0, len(generated), BATCH_SIZE), desc=f"{label} (generate)", unit="batch"):
        batch = generated[start : start + BATCH_SIZE]
        outputs = generator.generate([GenerationRequest(item.prompt_messages, item.max_tokens) for item in batch])
        results |= {item.id: ItemResult(item.id, item.tags, item.metric, output, score(item, output))
                    for item, output in zip(batch, outputs)}
    return BusinessResult([results[item.id] for item in items])


def compare_business(base: BusinessResult, other: BusinessResult) -> dict:
    """Recovery (score / base score, overall and per tag) and agreement (share of identical answers)."""
    base_tags = base.tag_scores()
    return {
        "recovery": recovery(other.score, base.score),
        "tag_recovery": {tag: recovery(value, base_tags[tag]) for tag, value in other.tag_scores().items()},
        "agreement": mean(a.output == b.output for a, b in zip(base.items, other.items)),
    }


def recovery(value: float, base: float) -> float | None:
    """None where the base scores zero: no share of nothing can be kept or lost."""
    return value / base if base else None


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
