"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models, /health,
/metrics. The engine runs on its own thread; a request whose client goes away is aborted and its blocks freed."""
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmc.errors import LlmcError
from llmc.runtime.llm_engine import RequestOutput
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.serving.async_engine import AsyncLLMEngine, EngineBusy
from llmc.runtime.serving.metrics import ServerMetrics
from llmc.runtime.serving.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

DISCONNECT_POLL_SECONDS = 0.25


def error_response(status: int, message: str, error_type: str, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class ClientGone(Exception):
    pass


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


class ModelNotFound(LlmcError):
    pass


class Unauthorized(LlmcError):
    pass


def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    llm = engine.engine

    def check_api_key(request: Request) -> None:
        if request.headers.get("authorization") != f"Bearer {api_key}":
            raise Unauthorized("invalid or missing API key")

    metrics = ServerMetrics(llm)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="llmc", lifespan=lifespan)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)] if api_key else [])

    @app.exception_handler(Unauthorized)
    async def unauthorized(request: Request, error: Unauthorized):
        return error_response(401, str(error), "authentication_error")

    @app.exception_handler(EngineBusy)
    async def busy(request: Request, error: EngineBusy):
        return error_response(503, str(error), "server_overloaded", headers={"Retry-After": "1"})

    @app.exception_handler(ModelNotFound)
    async def unknown_model(request: Request, error: ModelNotFound):
        return error_response(404, str(error), "not_found_error")

    @app.exception_handler(LlmcError)
    async def bad_request(request: Request, error: LlmcError):
        return error_response(400, str(error), "invalid_request_error")

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        details = "; ".join(f"{'.'.join(str(part) for part in item['loc'][1:])}: {item['msg']}" for item in error.errors())
        return error_response(400, details or "invalid request body", "invalid_request_error")

    def check_model(body: SamplingRequest) -> None:
        if body.model not in (None, model_name):
            raise ModelNotFound(f"model {body.model!r} is not served here; this server serves {model_name!r}")

    async def timed(outputs: AsyncIterator[RequestOutput], start: float) -> AsyncIterator[RequestOutput]:
        last = None
        async for output in outputs:
            now = time.monotonic()
            (metrics.time_to_first_token if last is None else metrics.inter_token_latency).observe(now - (last or start))
            last = now
            metrics.generation_tokens.inc(len(output.new_token_ids))
            if output.finish_reason:
                metrics.e2e_latency.observe(now - start)
                metrics.prompt_tokens.inc(output.num_prompt_tokens)
            yield output

    async def collect(request: Request, streams: list[AsyncIterator[RequestOutput]]) -> list[list[RequestOutput]]:
        """Run streams to the end; if the client disconnects first, cancel them (which aborts the requests)."""
        async def drain(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
            return [output async for output in stream]

        task = asyncio.gather(*(drain(stream) for stream in streams))
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise ClientGone
        return task.result()

    def logprobs_of(outputs: list[RequestOutput], chat: bool) -> dict | None:
        tokens = [token for output in outputs for token in output.new_logprobs]
        if not tokens:
            return None
        text = llm.tokenizer.decode
        if chat:
            return {"content": [
                {"token": text([t.token_id]), "logprob": t.logprob, "bytes": None,
                 "top_logprobs": [{"token": text([i]), "logprob": lp, "bytes": None} for i, lp in t.top_logprobs.items()]}
                for t in tokens
            ]}
        return {
            "tokens": [text([t.token_id]) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{text([i]): lp for i, lp in t.top_logprobs.items()} for t in tokens],
        }

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}

    def choice(index: int, outputs: list[RequestOutput], chat: bool, delta: bool) -> dict:
        text = "".join(output.new_text for output in outputs)
        finish_reason = outputs[-1].finish_reason if outputs else None
        entry = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs_of(outputs, chat)}
        if not chat:
            entry["text"] = text
        elif delta:
            entry["delta"] = {"content": text} if text or not finish_reason else {}
        else:
            entry["message"] = {"role": "assistant", "content": text}
        return entry

    async def respond(request: Request, body: SamplingRequest, prompts: list[list[int]], params: list[SamplingParams], chat: bool):
        """Each prompt answered len(params) times; choice i * len(params) + j is prompt i's answer under params[j]."""
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        header = {"id": response_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()), "model": model_name}
        start = time.monotonic()
        streams = [timed(stream, start) for stream in engine.submit([(prompt, choice_params) for prompt in prompts for choice_params in params])]
        prompt_tokens = sum(map(len, prompts))
        if body.stream:
            header["object"] = "chat.completion.chunk" if chat else "text_completion"
            return StreamingResponse(sse(header, streams, prompt_tokens, chat, body.include_usage), media_type="text/event-stream")
        try:
            results = await collect(request, streams)
        except ClientGone:
            return Response(status_code=499)
        choices = [choice(index, outputs, chat, delta=False) for index, outputs in enumerate(results)]
        completion_tokens = sum(len(output.new_token_ids) for outputs in results for output in outputs)
        return header | {"choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    async def sse(header: dict, streams: list[AsyncIterator[RequestOutput]], prompt_tokens: int, chat: bool, include_usage: bool):
        if chat:
            opening = [{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None} for index in range(len(streams))]
            yield f"data: {json.dumps(header | {'choices': opening})}\n\n"
        completion_tokens = 0
        async with aclosing(merged(streams)) as outputs:  # a client gone closes this generator: stop the requests now
            async for index, output in outputs:
                completion_tokens += len(output.new_token_ids)
                yield f"data: {json.dumps(header | {'choices': [choice(index, [output], chat, delta=True)]})}\n\n"
        if include_usage:
            yield f"data: {json.dumps(header | {'choices': [], 'usage': usage(prompt_tokens, completion_tokens)})}\n\n"
        yield "data: [DONE]\n\n"

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        prompts = [llm.tokenize(prompt) for prompt in body.prompts()]
        return await respond(request, body, prompts, body.sampling_params(16, body.logprobs), chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body)
        if not llm.tokenizer.chat_template:
            raise LlmcError(f"{model_name} has no chat template; use /v1/completions")
        text = llm.tokenizer.apply_chat_template(body.conversation(), tokenize=False, add_generation_prompt=True)
        prompt = llm.tokenize(text)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, llm.max_model_len - len(prompt))
        body.max_tokens = max_tokens
        return await respond(request, body, [prompt], body.sampling_params(max_tokens, logprobs), chat=True)

    @v1.get("/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "llmc", "max_model_len": llm.max_model_len}
        return {"object": "list", "data": [card]}

    app.include_router(v1)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(engine: AsyncLLMEngine, model_name: str, host: str, port: int, api_key: str | None) -> None:
    """Serve until SIGINT/SIGTERM; on either, uvicorn stops accepting and lets running requests finish."""
    import uvicorn

    uvicorn.run(build_app(engine, model_name, api_key), host=host, port=port, log_level="info", timeout_graceful_shutdown=None)
