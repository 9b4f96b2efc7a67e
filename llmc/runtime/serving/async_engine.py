"""Runs an LLMEngine on its own thread and streams each request's outputs to asyncio callers."""
import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator

from llmc.errors import LlmcError
from llmc.runtime.llm_engine import LLMEngine, RequestOutput
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.serving import DEFAULT_MAX_WAITING


class EngineBusy(LlmcError):
    """Every running and waiting slot is taken; the caller should retry later."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = DEFAULT_MAX_WAITING):
        self.engine = engine
        self.max_requests = engine.config.max_num_seqs + max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmc-engine", daemon=True)

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(None)
        self._thread.join()

    def submit(self, requests: list[tuple[list[int], SamplingParams]]) -> list[AsyncIterator[RequestOutput]]:
        """Check and queue (prompt, params) requests now (errors raise here, before any is queued); return their
        output streams."""
        if len(requests) > self.max_requests:
            raise LlmcError(f"the request asks for {len(requests)} sequences; this server holds at most {self.max_requests}")
        if self.num_requests + len(requests) > self.max_requests:
            raise EngineBusy(f"the server is at capacity ({self.max_requests} requests); retry later")
        for token_ids, params in requests:
            self.engine.check_prompt(token_ids)
            self.engine.check_structured_output(params)
        streams = []
        for token_ids, params in requests:
            request_id, stream = uuid.uuid4().hex, asyncio.Queue()
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
            self._commands.put(("add", token_ids, params, request_id))
            streams.append(self._outputs(request_id, stream))
        return streams

    async def _outputs(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine makes them; leaving early aborts it and frees its blocks."""
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finish_reason is not None
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    def _apply(self, command: tuple) -> None:
        if command[0] == "add":
            _, token_ids, params, request_id = command
            if request_id in self._streams:
                self.engine.add_request(token_ids, params, request_id)
            else:
                self.engine.count_abandoned()
        else:
            self.engine.abort(command[1])

    def _run(self) -> None:
        while not self._stopped.is_set():
            if not self.engine.has_unfinished():
                command = self._commands.get()  # idle: sleep until there is work
                if command is None:
                    return
                self._apply(command)
            while not self._commands.empty():
                command = self._commands.get()
                if command is None:
                    return
                self._apply(command)
            for output in self.engine.step():
                # a finished request's stream is dropped here too, in case its caller never started reading it
                target = (self._streams.pop if output.finish_reason else self._streams.get)(output.request_id, None)
                if target is not None:
                    loop, stream = target
                    loop.call_soon_threadsafe(stream.put_nowait, output)
