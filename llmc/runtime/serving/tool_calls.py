"""Tool calling in the Hermes format (a `<tool_call>` tag around {"name": ..., "arguments": {...}}), which Qwen2.5 and
SmolLM2-style chat templates use: the tools go into the prompt (through the chat template when it renders tools, else
as a system message llmc writes), the output is constrained with xgrammar's structural tag for that format (the same
grammar machinery as response_format), and the calls are parsed out of the text, whole or as it streams."""
import json
import re
import uuid
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmc.runtime.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from xgrammar.structural_tag import StructuralTag, TagFormat

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)
XGRAMMAR_FORMAT = "qwen_3"  # xgrammar's name for this Hermes-style <tool_call> JSON format
MAX_WHITESPACE = 16  # per run inside a call's JSON: enough for pretty-printing, not for a model stuck on blanks


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # either way the arguments are constrained to the parameters' schema


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def tool_grammar(tools: list[ToolDefinition], tool_choice: ToolChoice, parallel_tool_calls: bool) -> StructuredOutput:
    """auto: free text, and any tool call in it well-formed for one of the tools; required: the calls alone, one or
    (with parallel calls) more; a named function: exactly one call of it. A forced call's grammar ends when the call
    closes, so the choice finishes with tool_calls, sampled or greedy."""
    from llmc.runtime.engine.grammar import import_xgrammar

    xgrammar = import_xgrammar()
    choice = tool_choice.model_dump() if isinstance(tool_choice, NamedToolChoice) else tool_choice
    tag = xgrammar.get_model_structural_tag(XGRAMMAR_FORMAT, tools=[tool.model_dump(exclude_none=True) for tool in tools],
                                            tool_choice=choice, reasoning=False, parallel_tool_calls=parallel_tool_calls,
                                            max_whitespace_cnt=MAX_WHITESPACE)
    if tool_choice == "required":
        tag = calls_only(tag.format.tags, parallel_tool_calls)
    return StructuredOutput("structural_tag", tag.model_dump_json(), field="tools")


def calls_only(call_tags: list["TagFormat"], parallel_tool_calls: bool) -> "StructuralTag":
    """The structural tag for nothing but calls (each one of call_tags), a newline between two. xgrammar's own
    required mode is triggered tags, which allow free text after the calls: a sampled model wrote on to max_tokens."""
    from xgrammar.structural_tag import StructuralTag, TagsWithSeparatorFormat

    return StructuralTag(format=TagsWithSeparatorFormat(tags=call_tags, separator="\n", at_least_one=True,
                                                        stop_after_first=not parallel_tool_calls))


def call_text(name: str, arguments: dict) -> str:
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_CLOSE}"


def tools_system_prompt(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(tool) for tool in tools)
    return (f"You may call these functions:\n<tools>\n{listed}\n</tools>\n"
            f"To call one, write its name and arguments as JSON in tags:\n{call_text('name', {'argument': 'value'})}")


def hermes_conversation(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation for a chat template that does not render tools: the tools in the system message, earlier
    calls as tagged text, tool results as user turns in <tool_response> tags."""
    rendered = []
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = [call_text(call["function"]["name"], call["function"]["arguments"]) for call in message["tool_calls"]]
            rendered.append({"role": "assistant", "content": "\n".join(filter(None, [message.get("content") or "", *calls]))})
        elif message["role"] == "tool":
            rendered.append({"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"})
        else:
            rendered.append({"role": message["role"], "content": message.get("content") or ""})
    if rendered and rendered[0]["role"] == "system":
        return [{"role": "system", "content": f"{rendered[0]['content']}\n\n{tools_system_prompt(tools)}"}, *rendered[1:]]
    return [{"role": "system", "content": tools_system_prompt(tools)}, *rendered]


def chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    if tools and "tools" not in tokenizer.chat_template:
        messages, tools = hermes_conversation(messages, tools), None
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def openai_tool_call(payload: str, index: int) -> dict | None:
    """One call as OpenAI's tool_calls entry (arguments as a JSON string), or None if payload is no call."""
    try:
        call = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    function = {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content, tool calls): the calls found in text, and the text around them."""
    calls, content, end = [], [], 0
    for match in CALL.finditer(text):
        call = openai_tool_call(match.group(1), len(calls))
        if call is not None:
            calls.append(call)
            content.append(text[end : match.start()])
            end = match.end()
    content.append(text[end:])
    return "".join(content).strip() if calls else text, calls


class ToolCallStream:
    """Splits one choice's streamed text into content deltas and whole tool calls: text that may still open a call is
    held back, and a call is sent once its closing tag arrives. Whitespace is held until text follows it, so the
    whitespace around calls (a newline between two) is not sent, as parse_tool_calls strips it from a whole answer."""

    def __init__(self):
        self.pending = ""
        self.num_calls = 0
        self.held_whitespace = ""
        self.sent_text = False

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        self.pending += text
        content, calls = [], []
        while True:
            start = self.pending.find(CALL_OPEN)
            if start == -1:
                safe = len(self.pending) if finished else self._safe_end()
                content.append(self._visible(self.pending[:safe]))
                self.pending = self.pending[safe:]
                break
            match = CALL.match(self.pending, start)
            if match is None:  # a call still being written
                content.append(self._visible(self.pending[:start]))
                self.pending = self.pending[start:]
                if finished:
                    content.append(self._visible(self.pending))
                    self.pending = ""
                break
            call = openai_tool_call(match.group(1), self.num_calls)
            content.append(self._visible(self.pending[:start] if call is not None else self.pending[: match.end()]))
            if call is not None:
                calls.append(call)
                self.num_calls += 1
            self.pending = self.pending[match.end() :]
        if finished and not self.num_calls:  # no calls: the text is sent as it is, its trailing whitespace too
            content.append(self.held_whitespace)
        return "".join(content), calls

    def _visible(self, text: str) -> str:
        """What of text (after the whitespace held so far) can be sent: all but its trailing whitespace, which is held;
        leading whitespace is dropped once a call has come before any text."""
        text = self.held_whitespace + text
        body = text.rstrip()
        self.held_whitespace = text[len(body) :]
        if not self.sent_text and self.num_calls:
            body = body.lstrip()
        self.sent_text = self.sent_text or bool(body)
        return body

    def _safe_end(self) -> int:
        """How much of pending cannot be the start of CALL_OPEN."""
        for length in range(min(len(CALL_OPEN) - 1, len(self.pending)), 0, -1):
            if CALL_OPEN.startswith(self.pending[-length:]):
                return len(self.pending) - length
        return len(self.pending)
