"""The engine in a process of its own, as `llmc serve` runs it. In one process the engine thread and the HTTP event
loop take turns at the GIL, and the engine waits for it between two ops of every step; in two, neither waits for
the other. Commands and outputs cross two pipes as msgpack (msgspec), typed on both ends."""
import asyncio
import contextlib
import logging
import multiprocessing
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec

from llmc.core.errors import LlmcError
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.engine.engine_stats import EngineStats
from llmc.runtime.engine.llm_engine import RequestOutput
from llmc.runtime.engine.request_checks import RequestChecks, eos_token_ids
from llmc.runtime.llm import LLM
from llmc.runtime.serving import DEFAULT_MAX_WAITING
from llmc.runtime.serving.async_engine import EngineCommand, StreamingEngine, apply_commands
from llmc.runtime.serving.limits import HEALTH_STALL_SECONDS

logger = logging.getLogger(__name__)
STOP_SECONDS = 30.0


@dataclass(slots=True)
class EngineReady:
    max_model_len: int = 0
    error: str | None = None  # the engine could not be built: why


@dataclass(slots=True)
class StepReply:
    outputs: list[RequestOutput] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)


HEARTBEAT_SECONDS = 1.0  # the engine replies at least this often (between steps, outputs or not), idle or busy


def read_commands(commands: Connection, decode, into: queue.SimpleQueue) -> None:
    """The engine's reader: every command off the pipe as soon as it arrives, so the server's writes never wait for
    a step to end (nor for the engine's own write of a long reply); the end of the pipe reads as a stop."""
    try:
        while True:
            into.put(decode(commands.recv_bytes()))
    except (EOFError, OSError):  # the server is gone
        into.put(EngineCommand("stop"))


def run_engine(folder: str, config: EngineConfig, threads: int, commands: Connection, replies: Connection) -> None:
    """The engine process: build the engine, then step while there is work and apply commands between steps."""
    import torch

    # Ctrl-C and a SIGTERM to the process group reach the engine too; the server drains its requests and then stops
    # the engine itself (and if the server is killed, the engine reads the end of its pipe and exits)
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, signal.SIG_IGN)
    torch.set_num_threads(threads)
    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(EngineCommand).decode
    try:
        engine = LLM(folder, config)
    except LlmcError as error:
        replies.send_bytes(encode(EngineReady(error=str(error))))
        return
    replies.send_bytes(encode(EngineReady(engine.max_model_len)))
    inbox: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
    threading.Thread(target=read_commands, args=(commands, decode, inbox), name="llmc-commands", daemon=True).start()
    last_reply = time.monotonic()
    try:
        while True:
            pending = []
            if not engine.has_unfinished():  # idle: sleep until there is work, or it is time for a heartbeat
                with contextlib.suppress(queue.Empty):
                    pending.append(inbox.get(timeout=HEARTBEAT_SECONDS))
            while not inbox.empty():
                pending.append(inbox.get())
            outputs, stop = apply_commands(engine, pending)
            if stop:
                return
            outputs += engine.step()
            # an abort changes the counters without an output; the heartbeat tells the server the engine is alive
            if outputs or pending or time.monotonic() - last_reply > HEARTBEAT_SECONDS:
                replies.send_bytes(encode(StepReply(outputs, engine.stats())))
                last_reply = time.monotonic()
    except (EOFError, BrokenPipeError):  # the server is gone
        return


class EngineProcess(StreamingEngine):
    """The engine in a child process. Built here, before the server starts: an engine that cannot be built is a
    clear error, not a server that never answers. Commands go out through a writer thread and replies are read on
    the event loop, so neither process waits on the other's pipe."""

    def __init__(self, folder: Path, config: EngineConfig, threads: int, max_waiting: int = DEFAULT_MAX_WAITING,
                 stall_seconds: float = HEALTH_STALL_SECONDS):
        from transformers import AutoConfig, AutoTokenizer

        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch threads or CUDA state
        commands_out, commands_in = context.Pipe(duplex=False)
        replies_out, replies_in = context.Pipe(duplex=False)
        self._process = context.Process(target=run_engine, args=(str(folder), config, threads, commands_out, replies_in),
                                        name="llmc-engine", daemon=True)
        self._process.start()
        commands_out.close()
        replies_in.close()
        self._commands, self._replies = commands_in, replies_out
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode_reply = msgspec.msgpack.Decoder(StepReply).decode
        ready = self._ready()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        checks = RequestChecks(tokenizer, AutoConfig.from_pretrained(folder).vocab_size, ready.max_model_len,
                               eos_token_ids(tokenizer, folder))
        super().__init__(checks, config.max_num_seqs, max_waiting)
        self._stats = EngineStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_commands, name="llmc-engine-writer", daemon=True)
        self._writer.start()
        self._stall_seconds = stall_seconds
        self._last_reply = time.monotonic()

    @property
    def pid(self) -> int:
        return self._process.pid

    def _ready(self) -> EngineReady:
        try:
            ready = msgspec.msgpack.Decoder(EngineReady).decode(self._replies.recv_bytes())
        except EOFError:
            self._process.join()
            raise LlmcError(f"the engine process exited with code {self._process.exitcode} while loading the model "
                            "(its error is above)") from None
        if ready.error is not None:
            self._process.join()
            raise LlmcError(ready.error)
        return ready

    def start(self) -> None:
        """On the server's event loop: outputs are read there as soon as the engine sends them."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._replies.fileno(), self._receive)

    def stop(self) -> None:
        if self._loop is not None and self.failure is None:
            self._loop.remove_reader(self._replies.fileno())
        if self._process.is_alive():
            self._send(EngineCommand("stop"))
            self._process.join(STOP_SECONDS)
        self._outbox.put(None)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def stats(self) -> EngineStats:
        return self._stats

    def health(self) -> str | None:
        if self.failure is not None:
            return self.failure
        if not self._process.is_alive():
            return f"the engine process exited with code {self._process.exitcode}"
        silent = time.monotonic() - self._last_reply
        if silent > self._stall_seconds:
            return f"the engine has not answered for {silent:.0f} s (it replies between steps, every {HEARTBEAT_SECONDS:.0f} s at least)"
        return None

    def _send(self, command: EngineCommand) -> None:
        """Encoded here (an error is the caller's), written by the writer thread."""
        self._outbox.put(self._encode(command))

    def _write_commands(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._commands.send_bytes(message)
            except (BrokenPipeError, OSError):  # the engine died: the reader sees its end and tells everyone
                return

    def _receive(self) -> None:
        try:
            reply = self._decode_reply(self._replies.recv_bytes())
        except (EOFError, OSError):
            self._engine_died()
            return
        self._last_reply = time.monotonic()
        self._stats = reply.stats
        for output in reply.outputs:
            destination = self._destination(output)
            if destination is not None:
                destination[1].put_nowait(output)

    def _engine_died(self) -> None:
        """Ends every open request with an error and stops the server (which then exits non-zero): nothing can answer
        its requests any more."""
        self._loop.remove_reader(self._replies.fileno())
        self._process.join()
        failure = f"the engine process exited with code {self._process.exitcode}"
        logger.error("%s; stopping the server", failure)
        self._fail_all(failure)
