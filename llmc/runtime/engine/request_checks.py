"""What a request must satisfy before it is queued. The engine checks with it, and so does a server whose engine
runs in another process, so a bad request gets its 400 before it reaches the engine."""
import json
from dataclasses import dataclass, field
from pathlib import Path

from llmc.core.errors import LlmcError
from llmc.runtime.engine.grammar import GrammarCompiler
from llmc.runtime.sampling_params import SamplingParams


def eos_token_ids(tokenizer, folder: Path) -> set[int]:
    ids = {tokenizer.eos_token_id} - {None}
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        ids |= set(value if isinstance(value, list) else [value] if value is not None else [])
    return ids


@dataclass
class RequestChecks:
    tokenizer: object
    vocab_size: int
    max_model_len: int
    eos_token_ids: set[int]
    grammars: GrammarCompiler = field(init=False)

    def __post_init__(self) -> None:
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)

    def check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise LlmcError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise LlmcError(f"the prompt has {len(token_ids)} tokens; this model accepts at most {self.max_model_len - 1}")
        if any(not 0 <= token < self.vocab_size for token in token_ids):
            raise LlmcError(f"prompt token ids must be in [0, {self.vocab_size})")

    def check_params(self, params: SamplingParams) -> None:
        """Refuses stop token ids outside the vocabulary, and a schema the grammar compiler cannot compile (compiled
        once: it is cached)."""
        if any(not 0 <= token < self.vocab_size for token in params.stop_token_ids):
            raise LlmcError(f"stop_token_ids must be in [0, {self.vocab_size})")
        if params.structured_output is not None:
            self.grammars.compile(params.structured_output)
