"""What a request asks of the engine: how to sample, and what its output is constrained to (compiled into a grammar
by llmc.runtime.engine.grammar)."""
from dataclasses import dataclass, field
from typing import Literal

from llmc.core.errors import LlmcError


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """kind json_object: any JSON object; json_schema: spec is a JSON schema; structural_tag: spec is an xgrammar
    structural tag (text with tagged JSON parts, such as tool calls). field names the request field it came from."""

    kind: Literal["json_object", "json_schema", "structural_tag"]
    spec: str = ""
    field: str = "response_format"


# temperatures below this decode greedily, as in vLLM: dividing logits by a tinier one overflows to inf and NaN
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # below GREEDY_BELOW_TEMPERATURE (0 included) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means the whole vocabulary
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives returned with each sampled token's logprob
    prompt_logprobs: int | None = None  # the same for each prompt token after the first; None: not computed
    structured_output: StructuredOutput | None = None  # None: unconstrained

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise LlmcError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise LlmcError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise LlmcError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 0:
            raise LlmcError(f"max_tokens must be >= 0, got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise LlmcError(f"{name} must be between 0 and 20, got {value}")
        if any(not text for text in self.stop):
            raise LlmcError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE
