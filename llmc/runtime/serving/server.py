"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models, /health,
/metrics. The engine runs in its own process (or on a thread, in tests); a request whose client goes away is
aborted and its blocks freed."""
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmc.errors import LlmcError
from llmc.runtime.llm_engine import RequestOutput
from llmc.runtime.request_checks import RequestChecks
from llmc.runtime.serving.async_engine import EngineBusy, StreamingEngine
from llmc.runtime.serving.metrics import ServerMetrics
from llmc.runtime.serving.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from llmc.runtime.serving.responses import completed, echoed, response_header, sse
from llmc.runtime.serving.tool_calls import chat_prompt

DISCONNECT_POLL_SECONDS = 0.25


def error_response(status: int, message: str, error_type: str, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class ClientGone(Exception):
    pass


class ModelNotFound(LlmcError):
    pass


class Unauthorized(LlmcError):
    pass


@dataclass
class ServerState:
    engine: StreamingEngine
    model_name: str
    metrics: ServerMetrics
    api_key: str | None = None

    @property
    def checks(self) -> RequestChecks:
        return self.engine.checks


def server_state(request: Request) -> ServerState:
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]


def check_api_key(request: Request, state: State) -> None:
    if state.api_key and request.headers.get("authorization") != f"Bearer {state.api_key}":
        raise Unauthorized("invalid or missing API key")


def check_model(body: SamplingRequest, model_name: str) -> None:
    if body.model not in (None, model_name):
        raise ModelNotFound(f"model {body.model!r} is not served here; this server serves {model_name!r}")


# exception handlers


async def unauthorized(request: Request, error: Unauthorized) -> JSONResponse:
    return error_response(401, str(error), "authentication_error")


async def busy(request: Request, error: EngineBusy) -> JSONResponse:
    return error_response(503, str(error), "server_overloaded", headers={"Retry-After": "1"})


async def unknown_model(request: Request, error: ModelNotFound) -> JSONResponse:
    return error_response(404, str(error), "not_found_error")


async def bad_request(request: Request, error: LlmcError) -> JSONResponse:
    return error_response(400, str(error), "invalid_request_error")


async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
    def described(item: dict) -> str:
        message = "unknown field (llmc serve implements no such parameter)" if item["type"] == "extra_forbidden" else item["msg"]
        return f"{'.'.join(str(part) for part in item['loc'][1:])}: {message}"

    details = "; ".join(described(item) for item in error.errors())
    return error_response(400, details or "invalid request body", "invalid_request_error")


# Starlette picks the handler of the nearest class in an error's MRO, so LlmcError only catches the rest.
EXCEPTION_HANDLERS = {
    Unauthorized: unauthorized,
    EngineBusy: busy,
    ModelNotFound: unknown_model,
    LlmcError: bad_request,
    RequestValidationError: invalid_body,
}


# streams


async def timed(outputs: AsyncIterator[RequestOutput], start: float, metrics: ServerMetrics) -> AsyncIterator[RequestOutput]:
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
    task = asyncio.gather(*(drain(stream) for stream in streams))
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientGone
    return task.result()


async def drain(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [output async for output in stream]


async def respond(request: Request, state: ServerState, body: SamplingRequest, prompts: list[list[int]], chat: bool) -> dict | Response:
    """Each prompt answered body.n times; choice i * n + j is prompt i's answer j."""
    header = response_header(state.model_name, chat, body.stream)
    start = time.monotonic()
    max_model_len, decode = state.checks.max_model_len, state.checks.tokenizer.decode
    requests = [(prompt, params) for prompt in prompts for params in body.sampling_params(len(prompt), max_model_len)]
    streams = [timed(stream, start, state.metrics) for stream in state.engine.submit(requests)]
    if body.echoes_prompt:
        streams = [echoed(stream, prompt, decode) for (prompt, _), stream in zip(requests, streams)]
    prompt_tokens = sum(map(len, prompts))
    if body.stream:
        events = sse(header, streams, decode, prompt_tokens, chat, body.include_usage, body.uses_tools)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        results = await collect(request, streams)
    except ClientGone:
        return Response(status_code=499)
    return completed(header, results, decode, prompt_tokens, chat, body.uses_tools)


# routes


v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
operations = APIRouter()


@v1.post("/completions")
async def completions(body: CompletionRequest, request: Request, state: State):
    check_model(body, state.model_name)
    prompts = [state.checks.tokenize(prompt) for prompt in body.prompts()]
    return await respond(request, state, body, prompts, chat=False)


@v1.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State):
    check_model(body, state.model_name)
    tokenizer = state.checks.tokenizer
    if not tokenizer.chat_template:
        raise LlmcError(f"{state.model_name} has no chat template; use /v1/completions")
    text = chat_prompt(tokenizer, body.conversation(), body.template_tools())
    return await respond(request, state, body, [state.checks.tokenize(text)], chat=True)


@v1.get("/models")
async def models(state: State):
    card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "llmc", "max_model_len": state.checks.max_model_len}
    return {"object": "list", "data": [card]}


@operations.get("/health")
async def health():
    return {"status": "ok"}


@operations.get("/metrics")
async def prometheus_metrics(state: State):
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@asynccontextmanager
async def lifespan(app: FastAPI):
    engine = app.state.server.engine
    engine.start()
    yield
    engine.stop()


def build_app(engine: StreamingEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="llmc", lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
    app.state.server = ServerState(engine, model_name, ServerMetrics(engine.stats), api_key)
    app.include_router(v1)
    app.include_router(operations)
    return app


def serve(engine: StreamingEngine, model_name: str, host: str, port: int, api_key: str | None) -> None:
    """Serve until SIGINT/SIGTERM; on either, uvicorn stops accepting and lets running requests finish."""
    import uvicorn

    uvicorn.run(build_app(engine, model_name, api_key), host=host, port=port, log_level="info", timeout_graceful_shutdown=None)
