"""Load generation and its measures, with vLLM's definitions: TTFT (arrival to first token), TPOT ((latency - TTFT)
/ (tokens - 1)), ITL (every gap between streamed chunks), throughput over the whole run; against a URL or an
in-process engine."""
import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import numpy as np

from llmc.bench.kv_sampler import KvSampler
from llmc.core.errors import LlmcError
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.serving.async_engine import AsyncLLMEngine

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    cancelled: bool = False


async def stream_from_url(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> AsyncIterator[int]:
    """Yields the number of tokens in each streamed chunk (one per chunk unless the server's usage says otherwise)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise LlmcError(f"{url} answered {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    yield 1


async def stream_from_engine(engine: AsyncLLMEngine, prompt: str, max_tokens: int) -> AsyncIterator[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    [outputs] = await engine.submit([(engine.engine.tokenize(prompt), params)])
    try:
        async for output in outputs:
            yield len(output.new_token_ids)
    finally:
        await outputs.aclose()  # aborts the request when the caller stopped early


async def measure(chunks: AsyncIterator[int], result: RequestResult, cancel_after: int | None) -> RequestResult:
    start = last = time.perf_counter()
    async for num_tokens in chunks:
        now = time.perf_counter()
        if result.output_tokens == 0:
            result.ttft = now - start
        else:
            result.itls.append(now - last)
        last = now
        result.output_tokens += num_tokens
        if cancel_after is not None and result.output_tokens >= cancel_after:
            result.cancelled = True
            await chunks.aclose()
            break
    result.latency = last - start
    return result


async def run_load(open_stream, prompts: list[str], prompt_tokens: list[int], max_tokens: int, concurrency: int | None,
                   request_rate: float | None, cancel_fraction: float, seed: int) -> tuple[list[RequestResult], float]:
    rng = random.Random(seed)
    cancel_after = [rng.randint(1, max(1, max_tokens // 2)) if rng.random() < cancel_fraction else None for _ in prompts]
    gate = asyncio.Semaphore(concurrency or len(prompts))

    async def one(index: int) -> RequestResult:
        async with gate:
            stream = open_stream(prompts[index], max_tokens)
            return await measure(stream, RequestResult(prompt_tokens[index]), cancel_after[index])

    start = time.perf_counter()
    tasks = []
    for index in range(len(prompts)):
        tasks.append(asyncio.create_task(one(index)))
        if request_rate:  # Poisson arrivals
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    stats = {"mean_ms": float(np.mean(values)) * 1e3}
    stats |= {f"p{p}_ms": float(np.percentile(values, p)) * 1e3 for p in PERCENTILES}
    return stats


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if not r.cancelled]
    output_tokens = sum(r.output_tokens for r in results)
    return {
        "completed": len(done),
        "cancelled": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in results),
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + sum(r.prompt_tokens for r in results)) / duration,
        "ttft": percentiles([r.ttft for r in results]),
        "tpot": percentiles([(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]),
        "itl": percentiles([gap for r in results for gap in r.itls]),
        "e2el": percentiles([r.latency for r in done]),
        "ttft_first_ms": results[0].ttft * 1e3,
        "ttft_later_p50_ms": float(np.median([r.ttft for r in results[1:]])) * 1e3 if len(results) > 1 else None,
    }


async def bench_engine(engine: AsyncLLMEngine, prompts: list[str], **load) -> dict:
    engine.start()
    sampler = KvSampler(engine)
    poller = asyncio.create_task(sampler.run())
    try:
        prompt_tokens = [len(engine.engine.tokenize(prompt)) for prompt in prompts]
        results, duration = await run_load(lambda p, n: stream_from_engine(engine, p, n), prompts, prompt_tokens, **load)
        while engine.num_requests or engine.engine.has_unfinished():  # cancelled requests are still being aborted
            await asyncio.sleep(0.01)
    finally:
        poller.cancel()
        engine.stop()
    return summarize(results, duration) | sampler.report()


async def bench_url(url: str, model: str, api_key: str | None, prompts: list[str], prompt_tokens: list[int], **load) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=None, headers=headers) as client:
        results, duration = await run_load(
            lambda p, n: stream_from_url(client, url, model, p, n), prompts, prompt_tokens, **load)
    return summarize(results, duration)
