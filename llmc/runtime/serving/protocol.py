"""The OpenAI request bodies the server accepts, and their translation into SamplingParams."""
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmc.core.errors import LlmcError
from llmc.runtime.sampling_params import SamplingParams, StructuredOutput
from llmc.runtime.serving.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_CONTENT_PARTS,
    MAX_INT32,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
)
from llmc.runtime.serving.tool_calls import NamedToolChoice, ToolChoice, ToolDefinition, tool_grammar

TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
Count = Annotated[int, Field(ge=0, le=MAX_INT32)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TextPrompts = Annotated[list[str], Field(max_length=MAX_PROMPTS)]
TokenPrompts = Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS)]

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# OpenAI fields llmc does not implement, with the values that ask for nothing: sent with one of those they pass,
# with any other they are refused by name rather than ignored
NOT_IMPLEMENTED: dict[str, tuple] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},), "best_of": (1,), "suffix": ("",),
    "functions": ([],), "function_call": ("none",),
    "prediction": (), "audio": (), "modalities": (["text"],),
    "service_tier": (), "reasoning_effort": (), "web_search_options": (), "metadata": ({},), "store": (False,),
}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # either way the output is constrained to the schema, as in vLLM


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise LlmcError("response_format: json_schema is required with type json_schema, and only with it")
        return self

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        return StructuredOutput("json_schema", json.dumps(self.json_schema.schema_))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


def wrapped_seed(seed: int) -> int:
    """seed kept in torch's int64 range (seed + choice may pass its end)."""
    return (seed - INT64_MIN) % 2**64 + INT64_MIN


def refuse_lone_surrogates(value: Any, path: str) -> None:
    """JSON's \\ud800-style escapes can spell text that is not Unicode (half of a surrogate pair), which neither the
    tokenizer nor the pipe to the engine can encode: refused by field."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            raise LlmcError(f"{path or 'body'}: is not valid Unicode (it holds half of a surrogate pair)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            refuse_lone_surrogates(key, path)
            refuse_lone_surrogates(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            refuse_lone_surrogates(item, f"{path}.{index}")


def document_not_implemented(schema: dict) -> None:
    """The OpenAPI schema lists the fields llmc does not implement with the one value each accepts (or null)."""
    for name, neutral in NOT_IMPLEMENTED.items():
        schema["properties"][name] = {"enum": [*neutral, None], "description": "Not implemented by llmc serve: only the "
                                      "value that asks for nothing is accepted"}


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=document_not_implemented)

    model: Name | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    temperature: float = Field(default=1.0, ge=0, le=2)  # below 1e-5: greedy, as in vLLM
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: Count = 0
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] = Field(default=[], max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=128)  # choices per prompt, OpenAI's bound
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None  # the client's end-user id; llmc keeps no per-user state, so it changes nothing
    response_format: ResponseFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_implemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        refuse_lone_surrogates(data, "")
        for name, neutral in NOT_IMPLEMENTED.items():
            if name in data and data[name] is not None and data[name] not in neutral:
                raise LlmcError(f"{name} is not supported by llmc serve")
        return {key: value for key, value in data.items() if key not in NOT_IMPLEMENTED}

    def check_fits(self, prompt_len: int, max_model_len: int, max_tokens: int) -> int:
        """max_tokens, or a 400 like vLLM's when the prompt and max_tokens together exceed the context (a prompt that
        alone is too long is the engine's to refuse)."""
        if prompt_len < max_model_len < prompt_len + max_tokens:
            raise LlmcError(f"this model's maximum context length is {max_model_len} tokens; the request asks for "
                            f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to generate): "
                            f"lower max_tokens to at most {max(max_model_len - prompt_len, 0)}")
        return max_tokens

    def resolved_max_tokens(self, prompt_len: int, max_model_len: int) -> int:
        """The most tokens to generate: max_tokens, else what the context leaves after the prompt."""
        if self.max_tokens is None:
            return max(1, max_model_len - prompt_len)
        return self.check_fits(prompt_len, max_model_len, self.max_tokens)

    def num_logprobs(self) -> int | None:
        """Top alternatives to return with each sampled token's logprob; None: no logprobs at all."""
        return None

    def sampling_params(self, prompt_len: int, max_model_len: int) -> list[SamplingParams]:
        """One per choice. With a seed, choice i samples from seed + i: the same request gives the same choices
        again, and its choices differ from each other."""
        structured_output = self.structured_output()
        return [
            SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=None if self.seed is None else wrapped_seed(self.seed + choice),
                max_tokens=self.resolved_max_tokens(prompt_len, max_model_len),
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                logprobs=self.num_logprobs(),
                prompt_logprobs=self.num_prompt_logprobs(),
                structured_output=structured_output,
            )
            for choice in range(self.n)
        ]

    def structured_output(self) -> StructuredOutput | None:
        return self.response_format.structured_output() if self.response_format else None

    def num_prompt_logprobs(self) -> int | None:
        """Top alternatives to return with each prompt token's logprob; None: the prompt's are not returned."""
        return None

    @property
    def echoes_prompt(self) -> bool:
        return False

    @property
    def uses_tools(self) -> bool:
        return False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: str | TextPrompts | list[TokenId] | TokenPrompts
    max_tokens: int | None = Field(default=COMPLETION_MAX_TOKENS, ge=0, le=MAX_INT32)  # 0, with echo: score the prompt only
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @model_validator(mode="after")
    def _nothing_to_generate_needs_echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise LlmcError("max_tokens 0 asks for nothing unless echo is true (the prompt and its logprobs come back)")
        return self

    def resolved_max_tokens(self, prompt_len: int, max_model_len: int) -> int:
        max_tokens = COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens  # null: the default
        return self.check_fits(prompt_len, max_model_len, max_tokens)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @property
    def echoes_prompt(self) -> bool:
        return self.echo

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise LlmcError("prompt must not be empty")
        return list(prompt)


class TextPart(BaseModel):
    """A message's content part; llmc serves text models, so text is the one kind."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=64)
    arguments: str | dict = "{}"  # a JSON object, as OpenAI sends it: a string


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: Name | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: OpenAI's newer name for system
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: Name | None = None  # a participant's name, passed to the chat template
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS)  # an assistant's earlier calls
    tool_call_id: Name | None = None  # a tool message's answer to that call

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """As chat templates take it: text content; a call's arguments as a dict."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [{"type": "function", "id": call.id, "function": {
                "name": call.function.name, "arguments": parsed_arguments(call.function.arguments)}} for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def parsed_arguments(arguments: str | dict) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise LlmcError(f"messages: a tool call's arguments are not a JSON object: {arguments[:80]!r}")
    return parsed


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # None: auto with tools, none without
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> "ChatCompletionRequest":
        names = [tool.function.name for tool in self.tools or []]
        if self.tool_choice not in (None, "none") and not names:
            raise LlmcError("tool_choice: asks for a tool call, but the request has no tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise LlmcError(f"tool_choice: names {self.tool_choice.function.name!r}, which is not among the tools {names}")
        if self.uses_tools and self.response_format is not None and self.response_format.type != "text":
            raise LlmcError("response_format: cannot be combined with tools (both constrain the output)")
        return self

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def structured_output(self) -> StructuredOutput | None:
        if not self.uses_tools:
            return super().structured_output()
        try:
            return tool_grammar(self.tools, self.tool_choice or "auto", self.parallel_tool_calls)
        except Exception as error:  # xgrammar's errors for a parameters schema it cannot take have no common type
            raise LlmcError(f"tools: their parameters cannot be made into a grammar: {error}") from None

    def resolved_max_tokens(self, prompt_len: int, max_model_len: int) -> int:
        if self.max_completion_tokens is not None:
            return self.check_fits(prompt_len, max_model_len, self.max_completion_tokens)
        return super().resolved_max_tokens(prompt_len, max_model_len)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        return [message.for_template() for message in self.messages]

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them; none when tool_choice is none (the model is not to call any)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.uses_tools else None
