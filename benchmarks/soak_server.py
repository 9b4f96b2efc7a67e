"""A mixed-load soak of a real `llmc serve` subprocess: concurrent clients (the official `openai` async client, and raw
httpx for the streams they cancel) send, for --minutes, a random mix of streamed and whole completions and chats,
streams closed after a few chunks, requests abandoned by a client timeout, `response_format` json_schema, tools
(tool_choice auto, required, a named function), echo with logprobs, n > 1, seeds, stop strings, and invalid bodies
(4xx expected). Reported: requests sent by kind, statuses, 5xx, errors (exceptions other than the cancellations the
client itself causes) with the exact request, answers that break their own constraint (JSON that does not parse,
a forced tool call missing), the server's RSS (HTTP process and the engine) at start and end, and, after every
client has stopped and the engine has gone idle, `llmc:kv_cache_usage_perc` from /metrics (blocks held by a
sequence over all blocks: prefix-cached blocks no sequence holds count as free, so an idle engine reads 0) and
/health. A progress line every minute.

    python benchmarks/soak_server.py /tmp/soak-artifact --minutes 30 --threads 1 --json soak.json
"""
import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from fuzz_server import count, health, llmc_serve, server_rss_mib

API_KEY = "soak-key"
MODEL_NAME = "soak"  # the server's --served-model-name, which every request names
REQUEST_TIMEOUT_S = 300.0
ABANDON_AFTER_S = 0.3  # the client timeout of the `abandoned` kind: the server is still generating
CHUNKS_BEFORE_CLOSE = 3
MAX_DEFECTS_KEPT = 20
PROMPTS = [
    "The quick brown fox",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Translate 'good morning' into French, German and Spanish.",
    "Once upon a time, in a small village by the mountains, there lived",
    "Explain what a hash table is to a ten-year-old. " * 12,  # a longer prompt: several KV blocks, shared prefixes
]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PERSON_SCHEMA = {"name": "person", "strict": True, "schema": {
    "type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}}
INVALID_BODIES = [  # (endpoint, body): each must get a 4xx
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}),
    ("/v1/completions", {"prompt": "hi", "n": 0}),
    ("/v1/completions", {"prompt": "hi", "no_such_field": 1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 1000}),
]


@dataclass
class Defect:
    kind: str
    what: str
    endpoint: str
    body: dict


@dataclass
class KindStats:
    sent: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    cancelled: int = 0  # by the client itself, as this kind intends
    errors: int = 0  # exceptions other than the intended cancellation
    broken_constraints: int = 0


@dataclass
class SoakReport:
    kinds: dict[str, KindStats] = field(default_factory=dict)
    defects: list[Defect] = field(default_factory=list)  # the first MAX_DEFECTS_KEPT

    def stats(self, kind: str) -> KindStats:
        return self.kinds.setdefault(kind, KindStats())

    def defect(self, kind: str, what: str, endpoint: str, body: dict) -> None:
        if len(self.defects) < MAX_DEFECTS_KEPT:
            self.defects.append(Defect(kind, what, endpoint, body))
            print(f"DEFECT {kind}: {what} {endpoint} {json.dumps(body)[:2000]}", flush=True)

    @property
    def sent(self) -> int:
        return sum(stats.sent for stats in self.kinds.values())

    @property
    def server_errors(self) -> int:
        return sum(n for stats in self.kinds.values() for status, n in stats.statuses.items() if status >= 500)

    @property
    def errors(self) -> int:
        return sum(stats.errors for stats in self.kinds.values())


@dataclass
class Request:
    kind: str
    endpoint: str
    body: dict
    stream: bool = False
    check: Callable[[dict], str | None] | None = None  # a whole answer's own constraint: what broke, or None


# ---- the mix: each builder gives one request of its kind


def chat_messages(rng: random.Random) -> list[dict]:
    return [{"role": "user", "content": rng.choice(PROMPTS)}]


def sampling(rng: random.Random) -> dict:
    """Greedy or sampled, with a seed half the time."""
    fields = {"temperature": rng.choice([0.0, 0.7, 1.0]), "max_tokens": rng.randint(8, 48)}
    if rng.random() < 0.5:
        fields["seed"] = rng.randrange(2**31)
    return fields


def completion(rng: random.Random) -> Request:
    return Request("completion", "/v1/completions", {"prompt": rng.choice(PROMPTS), **sampling(rng),
                                                      "stop": rng.choice([None, ["\n\n"], [".", "!"]])})


def completion_stream(rng: random.Random) -> Request:
    return Request("completion stream", "/v1/completions", {"prompt": rng.choice(PROMPTS), **sampling(rng), "stream": True},
                   stream=True)


def chat(rng: random.Random) -> Request:
    return Request("chat", "/v1/chat/completions", {"messages": chat_messages(rng), **sampling(rng), "stop": rng.choice([None, ["\n"]])})


def chat_stream(rng: random.Random) -> Request:
    return Request("chat stream", "/v1/chat/completions", {"messages": chat_messages(rng), **sampling(rng), "stream": True},
                   stream=True)


def cancelled_stream(rng: random.Random) -> Request:
    endpoint, prompt = rng.choice([("/v1/chat/completions", {"messages": chat_messages(rng)}),
                                   ("/v1/completions", {"prompt": rng.choice(PROMPTS)})])
    return Request("stream closed mid-way", endpoint, {**prompt, "max_tokens": 128, "stream": True, "n": rng.choice([1, 2])},
                   stream=True)


def abandoned(rng: random.Random) -> Request:
    return Request("abandoned (client timeout)", "/v1/chat/completions", {"messages": chat_messages(rng), "max_tokens": 128})


def json_schema(rng: random.Random) -> Request:
    body = {"messages": [{"role": "user", "content": "Describe a person as JSON."}], **sampling(rng), "max_tokens": 64,
            "response_format": rng.choice([{"type": "json_schema", "json_schema": PERSON_SCHEMA}, {"type": "json_object"}])}
    return Request("response_format", "/v1/chat/completions", body, check=parses_as_json)


def tools(rng: random.Random, choice) -> Request:
    body = {"messages": [{"role": "user", "content": "What is the weather and the time in Paris?"}], **sampling(rng),
            "max_tokens": 96, "tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": choice}
    name = choice if isinstance(choice, str) else "named"
    return Request(f"tools {name}", "/v1/chat/completions", body, check=None if choice == "auto" else has_a_tool_call)


def echo_logprobs(rng: random.Random) -> Request:
    body = {"prompt": rng.choice(PROMPTS), "echo": True, "logprobs": rng.choice([1, 5]), "max_tokens": rng.choice([0, 1, 8])}
    return Request("echo + logprobs", "/v1/completions", body)


def several_choices(rng: random.Random) -> Request:
    endpoint, prompt = rng.choice([("/v1/chat/completions", {"messages": chat_messages(rng)}),
                                   ("/v1/completions", {"prompt": rng.choice(PROMPTS)})])
    body = {**prompt, **sampling(rng), "n": rng.choice([2, 3, 4]), "temperature": 1.0, "stream": rng.random() < 0.5}
    return Request("n > 1", endpoint, body, stream=body["stream"])


def invalid(rng: random.Random) -> Request:
    endpoint, body = rng.choice(INVALID_BODIES)
    return Request("invalid (4xx expected)", endpoint, body)


MIX: list[tuple[Callable[[random.Random], Request], int]] = [
    (completion, 10), (completion_stream, 10), (chat, 10), (chat_stream, 10), (cancelled_stream, 8), (abandoned, 5),
    (json_schema, 8), (lambda rng: tools(rng, "auto"), 5), (lambda rng: tools(rng, "required"), 5),
    (lambda rng: tools(rng, {"type": "function", "function": {"name": "get_weather"}}), 5), (echo_logprobs, 8),
    (several_choices, 8), (invalid, 4),
]


def parses_as_json(answer: dict) -> str | None:
    choice = answer["choices"][0]
    if choice["finish_reason"] != "stop":
        return None
    try:
        json.loads(choice["message"]["content"])
    except (TypeError, json.JSONDecodeError):
        return f"content is not JSON: {choice['message']['content']!r}"
    return None


def has_a_tool_call(answer: dict) -> str | None:
    choice = answer["choices"][0]
    if choice["finish_reason"] == "length":
        return None
    if not choice["message"].get("tool_calls"):
        return f"forced tool call missing: finish_reason {choice['finish_reason']}, message {choice['message']}"
    return None


# ---- sending: the openai client for whole answers and full streams, raw httpx for what the client cancels


async def send_with_openai(client, request: Request) -> int:
    """The status of the answer; a broken constraint is raised as a ValueError."""
    import openai

    create = client.chat.completions.create if "chat" in request.endpoint else client.completions.create
    known = {"messages", "prompt", "max_tokens", "temperature", "seed", "stop", "stream", "n", "tools", "tool_choice",
             "response_format", "echo", "logprobs"}
    kwargs = {key: value for key, value in request.body.items() if key in known and value is not None}
    extra = {key: value for key, value in request.body.items() if key not in known}
    try:
        answer = await create(model=MODEL_NAME, **kwargs, extra_body=extra or None)
        if request.stream:
            async for _ in answer:
                pass
            return 200
    except openai.APIStatusError as error:
        return error.status_code
    if request.check and (broken := request.check(answer.model_dump())):
        raise ValueError(broken)
    return 200


async def send_and_close_early(http: httpx.AsyncClient, request: Request) -> int:
    async with http.stream("POST", request.endpoint, json={"model": MODEL_NAME, **request.body}) as response:
        chunks = 0
        async for line in response.aiter_lines():
            chunks += line.startswith("data:")
            if chunks >= CHUNKS_BEFORE_CLOSE:
                break
        return response.status_code


async def send_raw(http: httpx.AsyncClient, request: Request, timeout_s: float = REQUEST_TIMEOUT_S) -> int:
    return (await http.post(request.endpoint, json={"model": MODEL_NAME, **request.body}, timeout=timeout_s)).status_code


async def send(client, http: httpx.AsyncClient, request: Request, report: SoakReport) -> None:
    stats = report.stats(request.kind)
    stats.sent += 1
    try:
        if request.kind == "stream closed mid-way":
            status = await send_and_close_early(http, request)
        elif request.kind.startswith("abandoned"):
            try:
                status = await send_raw(http, request, ABANDON_AFTER_S)
            except httpx.TimeoutException:
                stats.cancelled += 1
                return
        elif request.kind.startswith("invalid"):
            status = await send_raw(http, request)
        else:
            status = await send_with_openai(client, request)
    except ValueError as broken:
        stats.broken_constraints += 1
        count(stats.statuses, 200)
        report.defect(request.kind, str(broken), request.endpoint, request.body)
        return
    except Exception as error:  # every other failure is a finding, recorded with its request
        stats.errors += 1
        report.defect(request.kind, f"{type(error).__name__}: {error}", request.endpoint, request.body)
        return
    count(stats.statuses, status)
    if request.kind == "stream closed mid-way" and status == 200:
        stats.cancelled += 1
    expected_4xx = request.kind.startswith("invalid")
    if status >= 500 or (expected_4xx and not 400 <= status < 500) or (not expected_4xx and status != 200):
        report.defect(request.kind, f"HTTP {status}", request.endpoint, request.body)


async def client_loop(seed: int, base: str, deadline: float, report: SoakReport) -> None:
    import openai

    rng = random.Random(seed)
    builders, weights = zip(*MIX, strict=True)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with (openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=API_KEY, timeout=REQUEST_TIMEOUT_S, max_retries=0) as client,
                httpx.AsyncClient(base_url=base, headers=headers, timeout=REQUEST_TIMEOUT_S) as http):
        while time.monotonic() < deadline:
            await send(client, http, rng.choices(builders, weights)[0](rng), report)


# ---- the server's state, read from outside


@dataclass
class EngineGauges:
    running: float
    waiting: float
    kv_cache_usage: float


async def engine_gauges(base: str) -> EngineGauges:
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"{base}/metrics")).text
    values = {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}
    return EngineGauges(values["llmc:num_requests_running"], values["llmc:num_requests_waiting"], values["llmc:kv_cache_usage_perc"])


async def idle_gauges(base: str, timeout_s: float = 120) -> EngineGauges:
    """The gauges once nothing runs or waits (the engine reports its counters about every second when idle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = await engine_gauges(base)
        if (gauges.running == 0 and gauges.waiting == 0 and gauges.kv_cache_usage == 0) or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(1)


@dataclass
class Progress:
    minute: float
    sent: int
    server_errors: int
    errors: int
    rss_mib: float
    kv_cache_usage: float
    health: int | str
    load_average: float  # the machine's, over the last minute: it is shared


async def every_minute(pid: int, base: str, report: SoakReport, started: float, deadline: float, log: list[Progress]) -> None:
    while time.monotonic() < deadline:
        await asyncio.sleep(min(60, max(0.0, deadline - time.monotonic())))
        gauges = await engine_gauges(base)
        progress = Progress(round((time.monotonic() - started) / 60, 1), report.sent, report.server_errors, report.errors,
                            round(server_rss_mib(pid), 1), gauges.kv_cache_usage, await asyncio.to_thread(health, base),
                            os.getloadavg()[0])
        log.append(progress)
        print(" ".join(f"{key}={value}" for key, value in asdict(progress).items()), flush=True)


@dataclass
class SoakRun:
    model: str
    minutes: float
    clients: int
    rss_start_mib: float
    rss_end_mib: float
    end_gauges: EngineGauges
    health_end: int | str
    report: SoakReport
    progress: list[Progress]


async def soak(pid: int, base: str, minutes: float, clients: int, model: str) -> SoakRun:
    report, progress = SoakReport(), []
    rss_start, started = server_rss_mib(pid), time.monotonic()
    deadline = started + minutes * 60
    await asyncio.gather(every_minute(pid, base, report, started, deadline, progress),
                         *(client_loop(seed, base, deadline, report) for seed in range(clients)))
    end_gauges = await idle_gauges(base)
    return SoakRun(model, minutes, clients, rss_start, server_rss_mib(pid), end_gauges, await asyncio.to_thread(health, base),
                   report, progress)


def print_run(run: SoakRun) -> None:
    print(f"{'kind':28} {'sent':>6} {'cancelled':>9} {'errors':>6} {'broken':>6}  statuses")
    for kind, stats in sorted(run.report.kinds.items()):
        statuses = dict(sorted(stats.statuses.items()))
        print(f"{kind:28} {stats.sent:6} {stats.cancelled:9} {stats.errors:6} {stats.broken_constraints:6}  {statuses}")
    print(f"requests sent {run.report.sent} in {run.minutes} min by {run.clients} clients; 5xx {run.report.server_errors}; "
          f"errors {run.report.errors}")
    print(f"RSS start / end {run.rss_start_mib:.0f} / {run.rss_end_mib:.0f} MiB; at the end, idle: running "
          f"{run.end_gauges.running:.0f}, waiting {run.end_gauges.waiting:.0f}, kv_cache_usage_perc {run.end_gauges.kv_cache_usage}; "
          f"/health {run.health_end}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="artifact folder or model spec for `llmc serve`")
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients, each sending one request at a time")
    parser.add_argument("--threads", type=int, default=1, help="the engine's CPU threads")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp(prefix="soak-server-")) / "server.log"
    print(f"server log: {log}", flush=True)
    with llmc_serve(args.model, args.threads, API_KEY, log, "--served-model-name", MODEL_NAME) as (pid, base):
        run = asyncio.run(soak(pid, base, args.minutes, args.clients, args.model))
    print_run(run)
    if args.json:
        args.json.write_text(json.dumps(asdict(run), indent=2, default=str))

if __name__ == "__main__":
    main()
