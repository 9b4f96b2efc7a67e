"""An LLM behind per-request asyncio output streams. StreamingEngine owns the streams and the checks made
before queueing; AsyncLLMEngine runs the engine on a thread of this process (in-process benchmarks, tests), and
serving.engine_process runs it in a process of its own."""
import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from llmc.core.errors import LlmcError
from llmc.runtime.engine.engine_stats import EngineStats
from llmc.runtime.engine.llm_engine import RequestOutput, failed_output
from llmc.runtime.engine.request_checks import RequestChecks
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.serving import DEFAULT_MAX_WAITING

logger = logging.getLogger(__name__)


class EngineBusy(LlmcError):
    """Every running and waiting slot is taken; the caller should retry later."""


class EngineGone(LlmcError):
    """The engine has stopped (it died, or the server is stopping): nothing can answer a request any more."""


class RequestFailed(Exception):
    """An error inside the engine ended this request (the engine goes on serving the others)."""


@dataclass(slots=True)
class EngineCommand:
    kind: str  # "add", "abort" or "stop"
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    params: SamplingParams | None = None


def apply_command(engine: LLM, command: EngineCommand, is_wanted: bool = True) -> RequestOutput | None:
    """An add whose caller has already gone (is_wanted False) is counted as aborted without being computed. An add
    the engine cannot take returns its request's failed output: the error ends that request alone."""
    try:
        if command.kind == "abort":
            engine.abort(command.request_id)
        elif is_wanted:
            engine.add_request(command.token_ids, command.params, command.request_id)
        else:
            engine.count_abandoned()
    except Exception as error:  # noqa: BLE001 - the server checked the request; whatever is left must not stop the engine
        logger.error("request %s could not be added: %s", command.request_id, error, exc_info=error)
        return failed_output(command.request_id, error)
    return None


def apply_commands(engine: LLM, commands: list[EngineCommand],
                   is_wanted: Callable[[str], bool] = lambda request_id: True) -> tuple[list[RequestOutput], bool]:
    """The commands in order, up to a stop: the failed outputs of the adds the engine could not take, and whether a
    stop came (the engine's loop then ends)."""
    failed = []
    for command in commands:
        if command.kind == "stop":
            return failed, True
        output = apply_command(engine, command, is_wanted(command.request_id))
        failed += [output] if output is not None else []
    return failed, False


class StreamingEngine:
    checks: RequestChecks

    def __init__(self, checks: RequestChecks, max_num_seqs: int, max_waiting: int):
        self.checks = checks
        self.max_requests = max_num_seqs + max_waiting
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.failure: str | None = None  # why the engine stopped, once it has
        self.on_failure: Callable[[], None] = lambda: None  # the server stops itself here

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError

    def health(self) -> str | None:
        """None when the engine serves; else why not."""
        return self.failure

    def _send(self, command: EngineCommand) -> None:
        raise NotImplementedError

    async def submit(self, requests: list[tuple[list[int], SamplingParams]]) -> list[AsyncIterator[RequestOutput]]:
        """Check and queue (prompt, params) requests now (errors raise here, before any is queued); return their
        output streams. The checks (grammar compilation among them) run off the event loop."""
        if len(requests) > self.max_requests:
            raise LlmcError(f"the request asks for {len(requests)} sequences; this server holds at most {self.max_requests}")
        self._check_capacity(len(requests))
        await asyncio.to_thread(self._check, requests)
        self._check_capacity(len(requests))  # others may have been queued meanwhile
        loop, streams = asyncio.get_running_loop(), []
        for token_ids, params in requests:
            request_id, stream = uuid.uuid4().hex, asyncio.Queue()
            self._streams[request_id] = (loop, stream)
            try:
                self._send(EngineCommand("add", request_id, token_ids, params))
            except BaseException:
                self._streams.pop(request_id)
                raise
            streams.append(self._outputs(request_id, stream))
        return streams

    def _check_capacity(self, num_requests: int) -> None:
        if self.failure is not None:
            raise EngineGone(f"the engine has stopped: {self.failure}")
        if self.num_requests + num_requests > self.max_requests:
            raise EngineBusy(f"the server is at capacity ({self.max_requests} requests); retry later")

    def _check(self, requests: list[tuple[list[int], SamplingParams]]) -> None:
        for token_ids, params in requests:
            self.checks.check_prompt(token_ids)
            self.checks.check_params(params)

    async def _outputs(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine makes them; leaving early aborts it and frees its blocks. A
        request the engine failed raises RequestFailed."""
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finish_reason is not None
                if output.finish_reason == "error":
                    raise RequestFailed(output.error)
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.failure is None:
                self._send(EngineCommand("abort", request_id))

    def _destination(self, output: RequestOutput) -> tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None:
        """Where an output goes. A finished request's stream is dropped here too, in case its caller never started
        reading it."""
        return (self._streams.pop if output.finish_reason else self._streams.get)(output.request_id, None)

    def _fail_all(self, failure: str) -> None:
        """The engine has stopped: every open request ends with an error, and the server is told."""
        self.failure = failure
        for request_id, (loop, stream) in list(self._streams.items()):
            loop.call_soon_threadsafe(stream.put_nowait, failed_output(request_id, failure))
        self._streams.clear()
        self.on_failure()


class AsyncLLMEngine(StreamingEngine):
    """The engine on a thread of this process. Its Python work shares the GIL with the caller's event loop."""

    def __init__(self, engine: LLM, max_waiting: int = DEFAULT_MAX_WAITING):
        super().__init__(engine.checks, engine.config.max_num_seqs, max_waiting)
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="llmc-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(EngineCommand("stop"))
        self._thread.join()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _send(self, command: EngineCommand) -> None:
        self._commands.put(command)

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as error:  # noqa: BLE001 - a fault outside any one request (the scheduler, say)
            logger.exception("the engine thread failed")
            self._fail_all(f"the engine thread failed: {type(error).__name__}: {error}")

    def _serve(self) -> None:
        while True:
            commands = [] if self.engine.has_unfinished() else [self._commands.get()]  # idle: sleep until there is work
            while not self._commands.empty():
                commands.append(self._commands.get())
            outputs, stop = apply_commands(self.engine, commands, self._streams.__contains__)
            if stop:
                return
            for output in outputs + self.engine.step():
                destination = self._destination(output)
                if destination is not None:
                    loop, stream = destination
                    loop.call_soon_threadsafe(stream.put_nowait, output)
