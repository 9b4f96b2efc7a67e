"""OpenAI response bodies from engine outputs: completion and chat choices with their logprobs and usage, whole
or as server-sent events with several choices streamed side by side."""
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace

from llmc.runtime.engine.llm_engine import RequestOutput
from llmc.runtime.layers.sampler import SampledToken
from llmc.runtime.serving.async_engine import RequestFailed
from llmc.runtime.serving.error_responses import ErrorBody, ErrorDetail
from llmc.runtime.serving.tool_calls import ToolCallStream, parse_tool_calls


async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several streams as they come, each with its stream's index. Leaving early (a client gone)
    cancels the streams still running, which aborts their requests."""
    arrivals: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    async def forward(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                arrivals.put_nowait((index, output))
        finally:
            arrivals.put_nowait((index, None))

    tasks = [asyncio.create_task(forward(index, stream)) for index, stream in enumerate(streams)]
    try:
        num_running = len(tasks)
        while num_running:
            index, output = await arrivals.get()
            if output is None:
                num_running -= 1
                tasks[index].result()  # a stream that failed fails the response
            else:
                yield index, output
    finally:
        for task in tasks:
            task.cancel()


Decode = Callable[[list[int]], str]


def chat_logprobs(tokens: list[SampledToken], decode: Decode) -> dict:
    return {"content": [
        {"token": decode([t.token_id]), "logprob": t.logprob, "bytes": None,
         "top_logprobs": [{"token": decode([i]), "logprob": lp, "bytes": None} for i, lp in t.top_logprobs.items()]}
        for t in tokens
    ]}


def completion_logprobs(tokens: list[SampledToken], decode: Decode) -> dict:
    """An echoed prompt's first token has no logprob (nothing comes before it): null, as in OpenAI's and vLLM's."""
    return {
        "tokens": [decode([t.token_id]) for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [None if t.top_logprobs is None else {decode([i]): lp for i, lp in t.top_logprobs.items()} for t in tokens],
    }


async def echoed(outputs: AsyncIterator[RequestOutput], prompt: list[int], decode: Decode) -> AsyncIterator[RequestOutput]:
    """The stream with the prompt in front of its first output: the prompt's text, and its tokens' logprobs when the
    request computed them."""
    first = True
    async for output in outputs:
        if first:
            prompt_logprobs = [] if output.prompt_logprobs is None else [SampledToken(prompt[0])] + output.prompt_logprobs[1:]
            output = replace(output, new_text=decode(prompt) + output.new_text, new_logprobs=prompt_logprobs + output.new_logprobs)
            first = False
        yield output


def logprobs_of(outputs: list[RequestOutput], decode: Decode, chat: bool) -> dict | None:
    tokens = [token for output in outputs for token in output.new_logprobs]
    if not tokens:
        return None
    return chat_logprobs(tokens, decode) if chat else completion_logprobs(tokens, decode)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def with_tool_calls(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason for an answer that ended after calling tools."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def choice(index: int, outputs: list[RequestOutput], decode: Decode, chat: bool, parse_tools: bool = False) -> dict:
    """A whole choice; with parse_tools, the tool calls in a chat answer become its message's tool_calls."""
    text = "".join(output.new_text for output in outputs)
    finish_reason = outputs[-1].finish_reason if outputs else None
    entry = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs_of(outputs, decode, chat)}
    if not chat:
        return entry | {"text": text}
    content, calls = parse_tool_calls(text) if parse_tools else (text, [])
    message = {"role": "assistant", "content": content or None, "tool_calls": calls} if calls else {"role": "assistant", "content": text}
    return entry | {"message": message, "finish_reason": with_tool_calls(finish_reason, bool(calls))}


def delta_choice(index: int, output: RequestOutput, decode: Decode, chat: bool, tool_stream: ToolCallStream | None) -> dict:
    """One streamed output of a choice; with a tool_stream, tool calls are sent whole as they close."""
    entry = {"index": index, "finish_reason": output.finish_reason, "logprobs": logprobs_of([output], decode, chat)}
    if not chat:
        return entry | {"text": output.new_text}
    text, calls = tool_stream.feed(output.new_text, output.finish_reason is not None) if tool_stream else (output.new_text, [])
    delta = ({"content": text} if text or not output.finish_reason else {}) | ({"tool_calls": calls} if calls else {})
    called = tool_stream is not None and tool_stream.num_calls > 0
    return entry | {"delta": delta, "finish_reason": with_tool_calls(output.finish_reason, called)}


def response_header(model_name: str, chat: bool, stream: bool) -> dict:
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": model_name}


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def sse(header: dict, streams: list[AsyncIterator[RequestOutput]], decode: Decode, prompt_tokens: int, chat: bool,
              include_usage: bool, parse_tools: bool = False) -> AsyncIterator[str]:
    if chat:
        opening = [{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
                   for index in range(len(streams))]
        yield event(header | {"choices": opening})
    completion_tokens = 0
    tool_streams = [ToolCallStream() if parse_tools else None for _ in streams]
    try:
        async with aclosing(merged(streams)) as outputs:  # a client gone closes this generator: stop the requests now
            async for index, output in outputs:
                completion_tokens += len(output.new_token_ids)
                yield event(header | {"choices": [delta_choice(index, output, decode, chat, tool_streams[index])]})
    except RequestFailed as failed:  # the status line has gone out: the error is the stream's last event
        yield event(ErrorBody(error=ErrorDetail(message=f"the engine failed on this request: {failed}",
                                                type="internal_server_error", code=500)).model_dump())
        yield "data: [DONE]\n\n"
        return
    if include_usage:
        yield event(header | {"choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    yield "data: [DONE]\n\n"


def completed(header: dict, results: list[list[RequestOutput]], decode: Decode, prompt_tokens: int, chat: bool,
              parse_tools: bool = False) -> dict:
    choices = [choice(index, outputs, decode, chat, parse_tools) for index, outputs in enumerate(results)]
    completion_tokens = sum(len(output.new_token_ids) for outputs in results for output in outputs)
    return header | {"choices": choices, "usage": usage(prompt_tokens, completion_tokens)}
