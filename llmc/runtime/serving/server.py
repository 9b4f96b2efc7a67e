"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models, /health,
/metrics. The engine runs in its own process (or on a thread, in tests); a request whose client goes away is
aborted and its blocks freed."""
import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmc.core.errors import LlmcError
from llmc.runtime.engine.llm_engine import RequestOutput
from llmc.runtime.engine.request_checks import RequestChecks
from llmc.runtime.serving.async_engine import EngineBusy, EngineGone, RequestFailed, StreamingEngine
from llmc.runtime.serving.error_responses import ERROR_RESPONSES, error_response
from llmc.runtime.serving.guard import RequestGuard
from llmc.runtime.serving.limits import MAX_REQUEST_BYTES
from llmc.runtime.serving.prometheus import ServerMetrics
from llmc.runtime.serving.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from llmc.runtime.serving.response_schema import ChatCompletionResponse, CompletionResponse, generation_responses
from llmc.runtime.serving.responses import completed, echoed, response_header, sse
from llmc.runtime.serving.tool_calls import chat_prompt

logger = logging.getLogger(__name__)
DISCONNECT_POLL_SECONDS = 0.25


class ClientGone(Exception):
    pass


class ModelNotFound(LlmcError):
    pass


@dataclass
class ServerState:
    engine: StreamingEngine
    model_name: str
    metrics: ServerMetrics

    @property
    def checks(self) -> RequestChecks:
        return self.engine.checks


def server_state(request: Request) -> ServerState:
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]


def check_model(body: SamplingRequest, model_name: str) -> None:
    if body.model not in (None, model_name):
        raise ModelNotFound(f"model {body.model!r} is not served here; this server serves {model_name!r}")


# exception handlers


async def busy(request: Request, error: EngineBusy) -> JSONResponse:
    return error_response(503, str(error), "server_overloaded", headers={"Retry-After": "1"})


async def engine_gone(request: Request, error: EngineGone) -> JSONResponse:
    return error_response(503, str(error), "service_unavailable")


async def request_failed(request: Request, error: RequestFailed) -> JSONResponse:
    return error_response(500, f"the engine failed on this request: {error}", "internal_server_error")


async def http_error(request: Request, error: StarletteHTTPException) -> Response:
    """Starlette's and FastAPI's own refusals (a body that is not JSON, an unknown path or method) in OpenAI's shape."""
    error_type = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return error_response(error.status_code, str(error.detail), error_type, headers=error.headers)


async def unexpected(request: Request, error: Exception) -> JSONResponse:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
    return error_response(500, f"internal error: {type(error).__name__}: {error}", "internal_server_error")


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
    EngineBusy: busy,
    EngineGone: engine_gone,
    RequestFailed: request_failed,
    Exception: unexpected,
    ModelNotFound: unknown_model,
    LlmcError: bad_request,
    RequestValidationError: invalid_body,
    StarletteHTTPException: http_error,
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
    streams = [timed(stream, start, state.metrics) for stream in await state.engine.submit(requests)]
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


v1 = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)
operations = APIRouter()


@v1.post("/completions", responses=generation_responses(CompletionResponse))
async def completions(body: CompletionRequest, request: Request, state: State):
    check_model(body, state.model_name)
    tokenize = state.checks.tokenize
    prompts = await asyncio.to_thread(lambda: [tokenize(prompt) for prompt in body.prompts()])  # off the event loop
    return await respond(request, state, body, prompts, chat=False)


def rendered_chat(checks: RequestChecks, body: ChatCompletionRequest, model_name: str) -> list[int]:
    """The conversation through the chat template, as tokens."""
    from jinja2 import TemplateError

    tokenizer = checks.tokenizer
    if not tokenizer.chat_template:
        raise LlmcError(f"{model_name} has no chat template; use /v1/completions")
    try:
        text = chat_prompt(tokenizer, body.conversation(), body.template_tools())
    except TemplateError as error:  # a template's raise_exception: roles out of order, say
        raise LlmcError(f"messages: the chat template refuses them: {error}") from None
    return checks.tokenize(text)


@v1.post("/chat/completions", responses=generation_responses(ChatCompletionResponse))
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State):
    check_model(body, state.model_name)
    prompt = await asyncio.to_thread(rendered_chat, state.checks, body, state.model_name)  # off the event loop
    return await respond(request, state, body, [prompt], chat=True)


@v1.get("/models")
async def models(state: State):
    card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "llmc", "max_model_len": state.checks.max_model_len}
    return {"object": "list", "data": [card]}


@operations.get("/health", responses={503: ERROR_RESPONSES[503]})
async def health(state: State):
    """200 while the engine serves; 503 once its process has died, or when it has not answered within the stall
    bound (`llmc serve --health-stall-seconds`)."""
    problem = state.engine.health()
    if problem is not None:
        return error_response(503, problem, "service_unavailable")
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


def build_app(engine: StreamingEngine, model_name: str, api_key: str | None = None,
              max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    app = FastAPI(title="llmc", lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
    app.state.server = ServerState(engine, model_name, ServerMetrics(engine.stats))
    app.include_router(v1)
    app.include_router(operations)
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes)
    return app


def serve(engine: StreamingEngine, model_name: str, host: str, port: int, api_key: str | None,
          max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
    """Serve until SIGINT/SIGTERM; on either, uvicorn stops accepting and lets running requests finish. If the
    engine dies, its open requests end with an error and the server stops: an LlmcError (a non-zero exit) says why."""
    import uvicorn

    app = build_app(engine, model_name, api_key, max_request_bytes)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=None))
    engine.on_failure = lambda: setattr(server, "should_exit", True)
    server.run()
    if engine.failure is not None:
        raise LlmcError(f"the server stopped: {engine.failure}")
