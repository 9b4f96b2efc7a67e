import asyncio
import json
import os
import signal

import httpx
import jsonschema
import openai
import pytest
import torch
from helpers import API_KEY, CORPUS, in_process_server, llmc_serve, post_v1, server_idle, wait_until, write_recipe

from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.serving.engine_process import EngineProcess

PROMPT = " ".join(CORPUS.split()[:12])
MAX_NUM_SEQS, MAX_WAITING = 4, 4


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_llama):
    folder = tmp_path_factory.mktemp("served")
    stage = "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n"
    return run_quantize(load_recipe(write_recipe(folder / "recipe.yaml", tiny_llama, folder / "artifact", stage)))


@pytest.fixture(scope="module")
def server(artifact):
    """The server as `llmc serve` runs it: the engine in its own process. `llm` is the same engine in process, the
    offline reference."""
    config = EngineConfig(dtype=torch.float32, max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=64)
    engine = EngineProcess(artifact, config, threads=1, max_waiting=MAX_WAITING)
    with in_process_server(engine, API_KEY) as running:
        running.llm = LLM(str(artifact), config)
        yield running


def test_completions_match_offline_generation_and_stream_the_same_text(server, artifact):
    offline = LLM(str(artifact), EngineConfig(dtype=torch.float32))
    expected = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    args = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    response = server.client.completions.create(**args)
    assert response.choices[0].text == expected["text"] and response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 20 and response.usage.prompt_tokens == len(offline.tokenize(PROMPT))
    chunks = list(server.client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == expected["text"]
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 20
    batch = server.client.completions.create(model="tiny", prompt=[PROMPT, "A stitch"], max_tokens=5, temperature=0)
    assert [choice.index for choice in batch.choices] == [0, 1] and batch.choices[0].text == expected["text"][: len(batch.choices[0].text)]


def test_chat_uses_the_chat_template_and_streams(server, artifact):
    messages = [{"role": "user", "content": "Quantization maps real numbers"}]
    offline = LLM(str(artifact), EngineConfig(dtype=torch.float32))
    prompt = offline.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]["text"]
    args = dict(model="tiny", messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    response = server.client.chat.completions.create(**args, logprobs=True, top_logprobs=2)
    message = response.choices[0].message
    assert message.role == "assistant" and message.content == expected
    assert len(response.choices[0].logprobs.content) == 12 and len(response.choices[0].logprobs.content[0].top_logprobs) == 2
    chunks = list(server.client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == expected


def test_n_choices_differ_repeat_with_their_seeds_and_stream_alike(server):
    args = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.5, seed=7, n=3, extra_body={"ignore_eos": True})
    response = server.client.completions.create(**args)
    texts = [choice.text for choice in response.choices]
    assert [choice.index for choice in response.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert response.usage.completion_tokens == 24 and response.usage.prompt_tokens == len(server.llm.tokenize(PROMPT))
    assert [choice.text for choice in server.client.completions.create(**args).choices] == texts
    assert server.client.completions.create(**args | {"n": 1, "seed": 8}).choices[0].text == texts[1]  # choice i: seed + i
    streamed = ["", "", ""]
    for chunk in server.client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    greedy = dict(model="tiny", prompt=[PROMPT, "A stitch"], max_tokens=4, temperature=0)
    single = [choice.text for choice in server.client.completions.create(**greedy).choices]
    doubled = server.client.completions.create(**greedy, n=2).choices
    assert [(choice.index, choice.text) for choice in doubled] == list(enumerate([single[0], single[0], single[1], single[1]]))
    chat = dict(model="tiny", messages=[{"role": "user", "content": "Quantization maps"}], max_tokens=6, temperature=1.5, seed=3, n=2)
    answers = [choice.message.content for choice in server.client.chat.completions.create(**chat).choices]
    chunks = list(server.client.chat.completions.create(**chat, stream=True))
    assert [choice.delta.role for choice in chunks[0].choices] == ["assistant", "assistant"]
    assert ["".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices if choice.index == index)
            for index in (0, 1)] == answers
    wait_until(lambda: server_idle(server))


def test_echo_returns_the_prompt_with_its_logprobs_as_lm_eval_scores_them(server):
    tokens = server.llm.tokenize(PROMPT)
    offline = server.llm.generate([tokens], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    scored = server.client.completions.create(model="tiny", prompt=[tokens], max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = scored.choices[0]
    assert choice.text.startswith(server.llm.tokenizer.decode(tokens)) and len(choice.logprobs.tokens) == len(tokens) + 1
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:-1] == pytest.approx([entry.logprob for entry in offline["prompt_logprobs"][1:]], abs=1e-5)
    tops, logprobs = choice.logprobs.top_logprobs[1:], choice.logprobs.token_logprobs[1:]
    assert all(max(top.values()) >= logprob - 1e-6 for top, logprob in zip(tops, logprobs))
    only_prompt = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    assert only_prompt.choices[0].text == PROMPT and only_prompt.usage.completion_tokens == 0
    assert only_prompt.choices[0].finish_reason == "length" and len(only_prompt.choices[0].logprobs.token_logprobs) == len(tokens)
    streamed = list(server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, stream=True))
    assert streamed[0].choices[0].text.startswith(PROMPT)
    assert "".join(chunk.choices[0].text for chunk in streamed) == PROMPT + server.client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, temperature=0).choices[0].text
    refused = httpx.post(f"{server.base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 0},
                         headers={"Authorization": f"Bearer {API_KEY}"})
    assert refused.status_code == 400 and "max_tokens 0" in refused.json()["error"]["message"]
    wait_until(lambda: server_idle(server))


def test_response_format_constrains_both_endpoints_and_a_bad_schema_is_a_400(server):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
              "maximum": 9}}, "required": ["city", "days"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "trip", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": PROMPT}]
    chat = server.client.chat.completions.create(model="tiny", messages=messages, response_format=response_format, n=3,
                                                 temperature=1.0, seed=3, max_tokens=60)
    completion = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0,
                                                  extra_body={"response_format": response_format})
    texts = [choice.message.content for choice in chat.choices] + [completion.choices[0].text]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    streamed = server.client.chat.completions.create(model="tiny", messages=messages, response_format={"type": "json_object"},
                                                     temperature=0, max_tokens=200, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text.startswith("{")
    bad = post_v1(server, "chat/completions", {"messages": messages, "response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "no-such-type"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("response_format: cannot be compiled")
    missing = post_v1(server, "chat/completions", {"messages": messages, "response_format": {"type": "json_schema"}})
    assert missing.status_code == 400 and "json_schema is required" in missing.json()["error"]["message"]
    wait_until(lambda: server_idle(server))


def test_models_health_and_metrics(server):
    assert [model.id for model in server.client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.base}/health").status_code == 200
    server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    metrics = httpx.get(f"{server.base}/metrics").text
    for name in ("llmc:time_to_first_token_seconds_count", "llmc:inter_token_latency_seconds_bucket",
                 "llmc:num_requests_running", "llmc:num_requests_waiting", "llmc:kv_cache_usage_perc",
                 "llmc:prefix_cache_hit_rate", "llmc:prefix_cache_queries_total", 'llmc:request_success_total{finished_reason="length"}'):
        assert name in metrics
    ttft_count = next(line for line in metrics.splitlines() if line.startswith("llmc:time_to_first_token_seconds_count"))
    assert float(ttft_count.split()[-1]) >= 1


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    with pytest.raises(openai.BadRequestError) as error:
        server.client.completions.create(model="tiny", prompt=PROMPT, temperature=-1)
    assert "temperature" in error.value.body["message"] and error.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="accepts at most 511"):
        server.client.completions.create(model="tiny", prompt=[5] * 2000)
    with pytest.raises(openai.BadRequestError, match="asks for 9 sequences; this server holds at most 8"):
        server.client.completions.create(model="tiny", prompt=PROMPT, n=MAX_NUM_SEQS + MAX_WAITING + 1)
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="other", prompt=PROMPT)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base}/v1", api_key="wrong").models.list()
    response = httpx.post(f"{server.base}/v1/completions", content=b"{not json", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400 and "error" in response.json()
    assert server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1



@pytest.mark.parametrize("field, value", [("functions", [{"name": "f"}]),
                                          ("presence_penalty", 0.3), ("frequency_penalty", 0.5),
                                          ("logit_bias", {"5": 10}), ("best_of", 3)])
def test_fields_llmc_does_not_implement_are_refused_by_name(server, field, value):
    chat = field == "functions"
    body = {"model": "tiny", "max_tokens": 2} | ({"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT})
    response = post_v1(server, "chat/completions" if chat else "completions", body | {field: value})
    assert response.status_code == 400 and response.json()["error"]["message"] == f"{field} is not supported by llmc serve"
    neutral = {"functions": [], "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "best_of": 1}[field]
    assert post_v1(server, "chat/completions" if chat else "completions", body | {field: neutral}).status_code == 200


def test_unknown_fields_and_max_tokens_past_the_context_are_refused(server):
    response = post_v1(server, "completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temprature": 0})
    assert response.status_code == 400 and response.json()["error"]["message"].startswith("temprature: unknown field")
    response = post_v1(server, "completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 1_000_000_000})
    assert response.status_code == 400 and "maximum context length is 512 tokens" in response.json()["error"]["message"]
    response = post_v1(server, "chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}],
                                                 "max_completion_tokens": 10_000})
    assert response.status_code == 400 and "lower max_tokens to at most" in response.json()["error"]["message"]
    assert server_idle(server)

async def open_stream(client: httpx.AsyncClient, base: str, max_tokens: int = 400):
    request = client.build_request(
        "POST", f"{base}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True},
    )
    response = await client.send(request, stream=True)
    lines = response.aiter_lines()
    return response, lines


def num_aborted(server) -> int:
    return (server.engine.stats().num_finished or {}).get("abort", 0)


def test_full_queue_answers_503_and_disconnects_free_blocks(server):
    aborted_before = num_aborted(server)

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            streams = [await open_stream(client, server.base, max_tokens=400) for _ in range(MAX_NUM_SEQS + MAX_WAITING)]
            for response, lines in streams[:MAX_NUM_SEQS]:
                assert response.status_code == 200 and (await anext(lines)).startswith("data: ")
            busy = await client.post(f"{server.base}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                                     json={"model": "tiny", "prompt": PROMPT})
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1" and "capacity" in busy.json()["error"]["message"]
            for response, _ in streams:
                await response.aclose()
    asyncio.run(scenario())
    wait_until(lambda: server_idle(server))
    # the streaming ones were aborted; a queued one may be dropped before it ever reached the engine
    assert num_aborted(server) >= aborted_before + MAX_NUM_SEQS


def test_non_streaming_client_that_gives_up_is_aborted(server):
    aborted_before = num_aborted(server)
    os.kill(server.engine.pid, signal.SIGSTOP)  # the engine holds still, so the request cannot finish first
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.base}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=0.3,
                       json={"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True})
        wait_until(lambda: server.engine.num_requests == 0)  # the server saw the client go
    finally:
        os.kill(server.engine.pid, signal.SIGCONT)
    wait_until(lambda: num_aborted(server) == aborted_before + 1)
    assert server_idle(server)


def test_soak_with_cancellations_leaks_no_blocks(server):
    num_requests, results, aborted_before = 30, [], num_aborted(server)

    async def one(client: openai.AsyncOpenAI, index: int, gate: asyncio.Semaphore):
        async with gate:
            stream = await client.completions.create(
                model="tiny", prompt=f"{PROMPT} {index}", max_tokens=24 + index, temperature=0.8, seed=index, stream=True)
            tokens, finish_reason = 0, None
            async for chunk in stream:
                tokens += 1
                finish_reason = chunk.choices[0].finish_reason
                if index % 5 == 0 and tokens == 3:  # every fifth client walks away mid-stream
                    await stream.close()
                    results.append("cancelled")
                    return
            results.append(finish_reason)

    async def scenario():
        client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0)
        gate = asyncio.Semaphore(MAX_NUM_SEQS + 2)
        await asyncio.gather(*(one(client, index, gate) for index in range(num_requests)))
        await client.close()

    asyncio.run(scenario())
    assert len(results) == num_requests and results.count("cancelled") == num_requests // 5
    assert set(results) <= {"cancelled", "stop", "length"}
    wait_until(lambda: server_idle(server))
    assert num_aborted(server) > aborted_before


def test_llmc_serve_finishes_running_requests_on_sigterm(artifact):
    with llmc_serve(artifact, "--dtype", "float32", "--kv-cache-gib", "0.01", "--served-model-name", "tiny") as (process, base):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
            lines = (line for line in response.iter_lines() if line)
            first = next(lines)
            process.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length" and len(rest) == 400
        # uvicorn re-raises the signal it captured once the graceful shutdown is done
        assert process.wait(timeout=120) in (0, -signal.SIGTERM)
        assert "Finished server process" in process.stdout.read()


def test_llmc_serve_stops_when_its_engine_process_dies(artifact):
    import psutil

    with llmc_serve(artifact, "--dtype", "float32", "--kv-cache-gib", "0.01", "--served-model-name", "tiny") as (process, base):
        (engine,) = [child for child in psutil.Process(process.pid).children()
                     if "spawn_main" in " ".join(child.cmdline()) and "resource_tracker" not in " ".join(child.cmdline())]
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
            lines = (line for line in response.iter_lines() if line)
            next(lines)
            engine.kill()
            rest = list(lines)
        # the open stream ends (it does not hang) with an error event, and the server exits non-zero on its own, so a
        # supervisor (Restart=on-failure) restarts it
        error = json.loads(rest[-2][6:])["error"]
        assert rest[-1] == "data: [DONE]" and error["code"] == 500 and "exited with code -9" in error["message"]
        assert process.wait(timeout=60) == 2
        assert "error: the server stopped: the engine process exited with code -9" in process.stdout.read()


def test_bench_against_the_url_with_poisson_arrivals(server):
    from llmc.bench.load import bench_url

    prompts = [f"{PROMPT} {index}" for index in range(6)]
    lengths = [len(server.llm.tokenize(prompt)) for prompt in prompts]
    load = dict(max_tokens=8, concurrency=None, request_rate=50.0, cancel_fraction=0.5, seed=1)
    results = asyncio.run(bench_url(server.base, "tiny", API_KEY, prompts, lengths, **load))
    assert results["completed"] + results["cancelled"] == 6 and results["cancelled"] > 0
    assert results["total_output_tokens"] >= 8 * results["completed"] and results["tpot"]["p50_ms"] > 0
    wait_until(lambda: server_idle(server))
