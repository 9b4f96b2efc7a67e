"""No request takes the server down, and faults are told, not hidden: errors inside one request end that request
alone, every field has a range, the body a size limit, the pipes to the engine process cannot deadlock, and /health
tells when the engine is gone or stalled."""
import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest
import torch
from helpers import API_KEY, CORPUS, build_tiny_model, in_process_server, wait_until

from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.serving.async_engine import AsyncLLMEngine
from llmc.runtime.serving.engine_process import EngineProcess

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = " ".join(CORPUS.split()[:12])
LONG_PROMPT_TOKENS = 25_000  # as msgpack: over 64 KiB, Linux's pipe buffer
MAX_NUM_SEQS, MAX_WAITING = 4, 4


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("long-tiny"), max_position_embeddings=32_768)


def config(**fields) -> EngineConfig:
    return EngineConfig(dtype=torch.float32, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=4096, **fields)


@pytest.fixture(scope="module")
def server(long_model):
    engine = EngineProcess(long_model, config(num_kv_blocks=2400), threads=1, max_waiting=MAX_WAITING, stall_seconds=3)
    with in_process_server(engine, API_KEY) as running:
        yield running


def post(base: str, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{base}/v1/{path}", json=body, headers=HEADERS, timeout=timeout)


def completion(server, **fields) -> httpx.Response:
    return post(server.base, "completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4} | fields)


def healthy(server) -> bool:
    return httpx.get(f"{server.base}/health", timeout=10).status_code == 200


def test_a_tiny_temperature_or_top_p_decodes_greedily_and_the_server_keeps_serving(server):
    greedy = completion(server, temperature=0, ignore_eos=True).json()["choices"][0]
    for temperature in (5e-324, 1e-6):
        tiny = completion(server, temperature=temperature, ignore_eos=True)
        assert tiny.status_code == 200 and tiny.json()["choices"][0] == greedy
    tiny_top_p = completion(server, top_p=5e-324, ignore_eos=True)  # 0 in float32: the likeliest token is kept
    assert tiny_top_p.status_code == 200 and tiny_top_p.json()["choices"][0] == greedy
    assert healthy(server) and completion(server).status_code == 200


@pytest.mark.parametrize("field, value", [("seed", 10**30), ("seed", -(10**30)), ("top_k", 10**30), ("max_tokens", 10**30),
                                          ("stop_token_ids", [10**30]), ("stop", ["x"] * 17), ("stop", "y" * 1025),
                                          ("prompt", [[5]] * 1025), ("stream_options", {"include_usage": True, "x": 1})])
def test_integers_and_lists_past_their_range_are_400s_naming_the_field_and_leak_no_slot(server, field, value):
    for _ in range(MAX_NUM_SEQS + MAX_WAITING + 1):  # a leaked slot each would fill the server
        response = completion(server, **{field: value})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"].startswith(field)
    assert server.engine.num_requests == 0 and completion(server).status_code == 200


@pytest.mark.parametrize("path, body", [
    ("completions", {"prompt": "a\ud800b"}), ("completions", {"prompt": "hi", "stop": ["\udfff"]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud83d"}]}),
])
def test_text_that_is_not_unicode_is_a_400(server, path, body):
    content = json.dumps({"model": "tiny", "max_tokens": 2} | body)  # ASCII escapes: valid JSON for half a surrogate pair
    response = httpx.post(f"{server.base}/v1/{path}", content=content, headers=HEADERS | {"Content-Type": "application/json"})
    assert response.status_code == 400 and "is not valid Unicode" in response.json()["error"]["message"]
    assert server.engine.num_requests == 0


def test_seeds_at_the_ends_of_their_range_are_served(server):
    for seed in (2**63 - 1, -(2**63)):
        choices = completion(server, seed=seed, n=2).json()["choices"]
        assert choices == completion(server, seed=seed, n=2).json()["choices"]


def test_stop_token_ids_outside_the_vocabulary_are_refused(server):
    response = completion(server, stop_token_ids=[2**31 - 1])
    assert response.status_code == 400 and "stop_token_ids must be in [0, " in response.json()["error"]["message"]


@pytest.mark.parametrize("message, expected", [
    ({"role": "assistant", "content": "", "tool_calls": [{}]}, "messages.0.tool_calls.0.function"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}, "JSON object"),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages.0.content"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages.0.content"),
    ({"role": "wizard", "content": "hi"}, "messages.0.role"),
])
def test_malformed_messages_are_400s(server, message, expected):
    response = post(server.base, "chat/completions", {"model": "tiny", "messages": [message], "max_tokens": 2})
    assert response.status_code == 400 and expected in response.json()["error"]["message"], response.text


def test_a_tool_without_its_function_is_a_400(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}
    response = post(server.base, "chat/completions", body)
    assert response.status_code == 400 and "tools.0.function" in response.json()["error"]["message"]


def test_the_body_limit_is_checked_before_parsing_and_the_key_before_the_body(server):
    huge = b'{"prompt": "' + b"a" * (16 * 2**20) + b'"}'
    response = httpx.post(f"{server.base}/v1/completions", content=huge, headers=HEADERS, timeout=60)
    assert response.status_code == 413 and "--max-request-bytes" in response.json()["error"]["message"]
    chunked = httpx.post(f"{server.base}/v1/completions", content=iter([huge[: 2**20]] * 17), headers=HEADERS, timeout=60)
    assert chunked.status_code == 413  # no Content-Length: counted as it arrives
    stranger = httpx.post(f"{server.base}/v1/completions", content=huge, headers={"Authorization": "Bearer nope"}, timeout=60)
    assert stranger.status_code == 401
    assert completion(server).status_code == 200


def test_pipes_do_not_deadlock_with_a_command_and_a_reply_each_over_the_pipe_buffer(server):
    """The engine writes a reply of megabytes (a long prompt's logprobs, echoed) while the server is not reading it
    (as when it used to block on a write) and a command of over 64 KiB (a 25,000-token prompt) goes the other way. The
    event loop stays free throughout, and both requests finish once the server reads again."""
    engine, loop = server.engine, server.engine._loop
    prompt = [128 + index % 256 for index in range(LONG_PROMPT_TOKENS)]
    loop.call_soon_threadsafe(loop.remove_reader, engine._replies.fileno())
    results = {}

    def request(name: str, body: dict) -> None:
        results[name] = post(server.base, "completions", {"model": "tiny", "max_tokens": 1} | body, timeout=300)

    echo = threading.Thread(target=request, args=("echo", {"prompt": prompt[:9000], "echo": True, "logprobs": 20}))
    echo.start()
    time.sleep(3)  # the engine has computed the echo and is blocked writing its reply
    long = threading.Thread(target=request, args=("long", {"prompt": prompt}))
    long.start()
    time.sleep(1)
    started = time.monotonic()
    assert httpx.get(f"{server.base}/v1/models", headers=HEADERS, timeout=10).status_code == 200
    assert time.monotonic() - started < 5
    loop.call_soon_threadsafe(loop.add_reader, engine._replies.fileno(), engine._receive)
    echo.join(300)
    long.join(300)
    assert results["echo"].status_code == 200 and results["long"].status_code == 200
    assert len(results["echo"].json()["choices"][0]["logprobs"]["tokens"]) == 9001
    assert results["long"].json()["usage"]["prompt_tokens"] == LONG_PROMPT_TOKENS


def test_health_is_503_while_the_engine_is_stalled_and_200_after(server):
    os.kill(engine_pid(server), signal.SIGSTOP)
    try:
        wait_until(lambda: not healthy(server), timeout=30)
        body = httpx.get(f"{server.base}/health", timeout=10).json()
        assert "has not answered for" in body["error"]["message"]
    finally:
        os.kill(engine_pid(server), signal.SIGCONT)
    wait_until(lambda: healthy(server), timeout=30)


def engine_pid(server) -> int:
    return server.engine.pid


def test_an_engine_death_ends_open_requests_with_errors_and_health_says_so(long_model):
    engine = EngineProcess(long_model, config(num_kv_blocks=256), threads=1, max_waiting=MAX_WAITING)
    told = threading.Event()
    engine.on_failure = told.set
    with in_process_server(engine, API_KEY) as running:
        results = {}
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True}
        waiting = threading.Thread(target=lambda: results.update(plain=post(running.base, "completions", body)))
        waiting.start()
        with httpx.stream("POST", f"{running.base}/v1/completions", json=body | {"stream": True}, headers=HEADERS,
                          timeout=120) as response:
            lines = (line for line in response.iter_lines() if line)
            next(lines)
            os.kill(engine.pid, signal.SIGKILL)
            rest = list(lines)
        waiting.join(60)
        assert rest[-1] == "data: [DONE]" and "exited with code -9" in json.loads(rest[-2][6:])["error"]["message"]
        assert results["plain"].status_code == 500 and "exited with code -9" in results["plain"].json()["error"]["message"]
        assert told.wait(10) and not healthy(running)
        later = post(running.base, "completions", body)
        assert later.status_code == 503 and "the engine has stopped" in later.json()["error"]["message"]


class FailingRunner:
    """The engine's runner, failing every forward that includes a sequence whose prompt starts with POISON."""

    POISON = 399

    def __init__(self, runner):
        self.runner = runner

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def run(self, seqs):
        if any(seq.token_ids[0] == self.POISON for seq in seqs):
            raise RuntimeError("injected fault")
        return self.runner.run(seqs)


@pytest.fixture(scope="module")
def poisoned_engine(long_model):
    engine = LLM(long_model, config(num_kv_blocks=256))
    engine.runner = FailingRunner(engine.runner)
    return engine


def test_an_error_in_one_request_ends_it_alone_in_the_engine(poisoned_engine, long_model):
    reference = LLM(long_model, config(num_kv_blocks=256))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [FailingRunner.POISON, 6, 7], [9, 10, 11]]
    for prompt in prompts:
        poisoned_engine.add_request(prompt, params)
    outputs = []
    while poisoned_engine.has_unfinished():
        outputs += poisoned_engine.step()
    failed = [output for output in outputs if output.finish_reason == "error"]
    assert len(failed) == 1 and failed[0].error == "RuntimeError: injected fault"
    expected = reference.generate([prompts[0], prompts[2]], params)
    tokens = {}
    for output in outputs:
        tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert sorted(tokens.values()) == sorted([[], *(result["token_ids"] for result in expected)])
    assert poisoned_engine.stats().num_used_blocks == 0


def test_an_error_in_one_request_is_its_500_or_error_event_and_the_others_are_served(poisoned_engine):
    with in_process_server(AsyncLLMEngine(poisoned_engine), API_KEY) as running:
        poisoned = [FailingRunner.POISON, 6, 7]

        async def scenario():
            async with httpx.AsyncClient(base_url=f"{running.base}/v1", headers=HEADERS, timeout=60) as client:
                body = {"model": "tiny", "max_tokens": 16, "ignore_eos": True, "temperature": 0}
                return await asyncio.gather(client.post("/completions", json=body | {"prompt": poisoned}),
                                            client.post("/completions", json=body | {"prompt": [5, 6, 7, 8]}),
                                            client.post("/completions", json=body | {"prompt": poisoned, "stream": True}))

        plain_failed, served, streamed = asyncio.run(scenario())
        assert plain_failed.status_code == 500 and "injected fault" in plain_failed.json()["error"]["message"]
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 16
        events = [line for line in streamed.text.splitlines() if line]
        assert events[-1] == "data: [DONE]" and "injected fault" in json.loads(events[-2][6:])["error"]["message"]
        assert completion(running).status_code == 200


def test_an_empty_api_key_is_refused(monkeypatch, long_model, capsys):
    from llmc.cli import main

    monkeypatch.setenv("LLMC_API_KEY", "")
    monkeypatch.setattr("sys.argv", ["llmc", "serve", str(long_model)])
    with pytest.raises(SystemExit) as exit_code:
        main()
    assert exit_code.value.code == 2 and "LLMC_API_KEY) is empty" in capsys.readouterr().err
