"""Tool calling: prompts rendered with the tools (the chat template's own way, or Hermes-style when it has none),
calls forced by tool_choice through the grammar, parsed whole and streamed, over the official openai client."""
import json

import jsonschema
import pytest
import torch
from helpers import API_KEY, build_tiny_model, in_process_server, post_v1, server_idle, wait_until
from transformers import AutoTokenizer

from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM
from llmc.runtime.serving.async_engine import AsyncLLMEngine
from llmc.runtime.serving.tool_calls import (
    NamedToolChoice,
    ToolCallStream,
    ToolDefinition,
    call_text,
    chat_prompt,
    parse_tool_calls,
    tool_grammar,
)

# small enough for the tiny model's 512-token context once rendered into the prompt
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
           "maximum": 7}}, "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny model with room in its context for the tools its prompts list (its vocabulary is nearly bytes)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tools"), max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(model):
    engine = AsyncLLMEngine(LLM(model, EngineConfig(dtype=torch.float32, num_kv_blocks=256)))
    with in_process_server(engine, API_KEY) as running:
        yield running


def assert_valid_calls(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.type == "function" and call.id.startswith("call_")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"])
def test_a_forced_tool_call_parses_and_validates_whole_and_streamed(server, tool_choice):
    args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=400)
    response = server.client.chat.completions.create(**args, temperature=1.0, seed=5, n=3)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert_valid_calls(choice.message.tool_calls)
        if isinstance(tool_choice, dict):
            assert choice.message.tool_calls[0].function.name == "get_time"
    chunks = list(server.client.chat.completions.create(**args, temperature=0, stream=True))
    streamed = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    assert_valid_calls(streamed)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = server.client.chat.completions.create(**args, temperature=0)
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in streamed]
    wait_until(lambda: server_idle(server))


def tool_matcher(tokenizer, tool_choice, parallel_tool_calls: bool):
    """The grammar matcher the engine would put on a request with these tools, built with xgrammar directly."""
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id])
    tools = [ToolDefinition.model_validate(tool) for tool in TOOLS]
    spec = tool_grammar(tools, tool_choice, parallel_tool_calls).spec
    return xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_structural_tag(spec))


def accepts(matcher, tokenizer, text: str) -> bool:
    return all(matcher.accept_token(token) for token in tokenizer.encode(text, add_special_tokens=False))


def allowed_next(matcher, tokenizer) -> set[str]:
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, len(tokenizer))
    matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, len(tokenizer))
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    return set(tokenizer.convert_ids_to_tokens(torch.nonzero(logits[0] > float("-inf")).flatten().tolist()))


@pytest.mark.parametrize("tool_choice, parallel_tool_calls", [
    ("required", False), ({"type": "function", "function": {"name": "get_time"}}, False),
    ({"type": "function", "function": {"name": "get_time"}}, True)], ids=["required", "named", "named-parallel"])
def test_a_forced_single_call_grammar_ends_when_the_call_closes(model, tool_choice, parallel_tool_calls):
    tokenizer = AutoTokenizer.from_pretrained(model)
    choice = NamedToolChoice.model_validate(tool_choice) if isinstance(tool_choice, dict) else tool_choice
    matcher = tool_matcher(tokenizer, choice, parallel_tool_calls)
    assert accepts(matcher, tokenizer, call_text("get_time", {"zone": "UTC"}))
    assert allowed_next(matcher, tokenizer) == {tokenizer.eos_token}  # no text after the call, no second call
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


def test_required_with_parallel_calls_takes_calls_a_newline_apart_and_nothing_else(model):
    tokenizer = AutoTokenizer.from_pretrained(model)
    matcher = tool_matcher(tokenizer, "required", parallel_tool_calls=True)
    assert not accepts(matcher, tokenizer, "Sure")  # no text before the first call
    matcher.reset()
    assert accepts(matcher, tokenizer, call_text("get_weather", {"city": "Rome", "days": 2}))
    assert allowed_next(matcher, tokenizer) == {tokenizer.eos_token, tokenizer.convert_ids_to_tokens(tokenizer.encode("\n"))[0]}
    assert accepts(matcher, tokenizer, "\n" + call_text("get_time", {"zone": "CET"}))
    assert not accepts(matcher, tokenizer, " and more")
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"])
def test_sampled_forced_calls_always_end_the_choice_with_tool_calls(server, tool_choice):
    """Temperature 1 with parallel calls allowed (the default): every choice is calls alone, ended by the grammar."""
    for seed in range(4):
        response = server.client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                                         max_tokens=400, temperature=1.0, seed=seed, n=4)
        for choice in response.choices:
            assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
            assert_valid_calls(choice.message.tool_calls)
    wait_until(lambda: server_idle(server))


def test_auto_and_none_and_a_conversation_with_tool_results(server):
    auto = server.client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=40, temperature=0)
    choice = auto.choices[0]
    if choice.message.tool_calls:  # a random model may or may not call: any call it makes must be well-formed
        assert_valid_calls(choice.message.tool_calls)
    else:
        assert choice.message.content is not None
    none = server.client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert none.choices[0].message.tool_calls is None
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}
    follow_up = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sun"}'}]
    answer = server.client.chat.completions.create(model="tiny", messages=follow_up, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_bad_tool_requests_are_400s_naming_the_field(server):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    cases = [({"tool_choice": "required"}, "tool_choice: asks for a tool call, but the request has no tools"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice: names 'nope'"),
             ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format: cannot be combined with tools"),
             ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name")]
    for extra, message in cases:
        response = post_v1(server, "chat/completions", body | extra)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_tools_render_through_a_template_that_knows_them_and_hermes_style_otherwise(model):
    tokenizer = AutoTokenizer.from_pretrained(model)  # its template has no tools
    earlier_call = {"type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}
    conversation = MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [earlier_call]}, {"role": "tool", "content": "12:00"}]
    hermes = chat_prompt(tokenizer, conversation, TOOLS)
    assert hermes.startswith("<system>") and '"name": "get_weather"' in hermes and "<tools>" in hermes
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in hermes
    assert "<user><tool_response>\n12:00\n</tool_response>" in hermes
    tokenizer.chat_template = "{{ tools | map(attribute='function.name') | join(',') }}|{% for m in messages %}{{ m['role'] }} {% endfor %}"
    assert chat_prompt(tokenizer, conversation, TOOLS) == "get_weather,get_time|user assistant tool "


def test_calls_are_parsed_out_of_text_whole_and_split_anywhere():
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    text = f"Let me check.\n{call}\n<tool_call>\nnot json\n</tool_call>"
    content, calls = parse_tool_calls(text)
    assert [call["function"] for call in calls] == [{"name": "get_time", "arguments": '{"zone": "CET"}'}]
    assert content == "Let me check.\n\n<tool_call>\nnot json\n</tool_call>"
    two_calls = f"{call}\n{call}"  # what tool_choice required writes with parallel calls
    for whole in (text, two_calls, "  no calls, spaces kept \n"):
        content, calls = parse_tool_calls(whole)
        for size in (1, 2, 5, 11, len(whole)):
            streamed_content, streamed_calls = streamed(whole, size)
            assert [call["function"] for call in streamed_calls] == [call["function"] for call in calls]
            assert streamed_content == content, (whole, size)
    assert parse_tool_calls(two_calls)[0] == ""
    assert parse_tool_calls("no calls <tool_call> here") == ("no calls <tool_call> here", [])


def streamed(text: str, size: int) -> tuple[str, list[dict]]:
    """text through a ToolCallStream in pieces of size characters: the content and the calls it sends."""
    stream, content, calls = ToolCallStream(), "", []
    pieces = [text[start : start + size] for start in range(0, len(text), size)]
    for index, piece in enumerate(pieces):
        piece_content, piece_calls = stream.feed(piece, finished=index == len(pieces) - 1)
        content, calls = content + piece_content, calls + piece_calls
    return content, calls
