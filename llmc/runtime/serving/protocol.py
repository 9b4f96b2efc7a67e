"""The OpenAI request bodies the server accepts, and their translation into SamplingParams."""
from pydantic import BaseModel, ConfigDict, Field

from llmc.errors import LlmcError
from llmc.runtime.sampling_params import SamplingParams

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=128)  # choices per prompt, OpenAI's bound
    stream: bool = False
    stream_options: dict | None = None

    def resolved_max_tokens(self, prompt_len: int, max_model_len: int) -> int:
        """The most tokens to generate: max_tokens, else what the context leaves after the prompt."""
        return self.max_tokens or max(1, max_model_len - prompt_len)

    def num_logprobs(self) -> int | None:
        """Top alternatives to return with each sampled token's logprob; None: no logprobs at all."""
        return None

    def sampling_params(self, prompt_len: int, max_model_len: int) -> list[SamplingParams]:
        """One per choice. With a seed, choice i samples from seed + i: the same request gives the same choices
        again, and its choices differ from each other."""
        return [
            SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=None if self.seed is None else self.seed + choice,
                max_tokens=self.resolved_max_tokens(prompt_len, max_model_len),
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                logprobs=self.num_logprobs(),
            )
            for choice in range(self.n)
        ]

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=COMPLETION_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    def resolved_max_tokens(self, prompt_len: int, max_model_len: int) -> int:
        return self.max_tokens or COMPLETION_MAX_TOKENS  # an explicit null gets the default too

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        if self.echo:
            raise LlmcError("echo is not supported")
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise LlmcError("prompt must not be empty")
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def resolved_max_tokens(self, prompt_len: int, max_model_len: int) -> int:
        return self.max_completion_tokens or super().resolved_max_tokens(prompt_len, max_model_len)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        def text(content: str | list[dict] | None) -> str:
            if isinstance(content, list):
                return "".join(part.get("text", "") for part in content if part.get("type") == "text")
            return content or ""

        return [{"role": message.role, "content": text(message.content)} for message in self.messages]
