"""The response bodies of the generation endpoints as the OpenAPI schema documents them (responses.py builds them as
dicts; tests/integration/test_fuzz_server.py holds every response the fuzzer gets to these schemas)."""
from typing import Literal

from pydantic import BaseModel


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # an echoed prompt's first token has none
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length", "abort"] | None
    logprobs: CompletionLogprobs | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CalledFunction(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string


class ResponseToolCall(BaseModel):
    index: int
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    logprobs: ChatLogprobs | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


def generation_responses(model: type[BaseModel]) -> dict:
    """A completion is JSON as `model` describes it, or with "stream": true server-sent events."""
    return {200: {"model": model, "description": "The completion", "content": {"text/event-stream": {}}}}
