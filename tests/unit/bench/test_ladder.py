"""`llmc bench --ladder`: the goodput search against a server of known capacity, transformers' static batches, the
rungs planned from what is given, and the command end to end on a tiny model (every rung, JSON, PNG, refusals)."""
import asyncio
import json
import math
import time
from pathlib import Path

import pytest
from helpers import llmc_in_process, write_recipe

from llmc.bench.goodput import SearchLimits, Slo, find_goodput
from llmc.bench.ladder import RungArtifacts, plan_rungs
from llmc.bench.load import RequestResult, measure

REPO = Path(__file__).resolve().parents[3]
BUSINESS = REPO / "calib_data" / "business" / "customer_service.jsonl"


def server_of_capacity(capacity: float, calls: list[float]):
    """A probe of a server that meets the SLO up to `capacity` requests/s and misses it above."""
    def probe(rate: float) -> dict:
        calls.append(rate)
        ttft = 100.0 if rate <= capacity else 5000.0
        return {"ttft": {"p90_ms": ttft, "p50_ms": ttft}, "tpot": {"p90_ms": 20.0, "p50_ms": 20.0}, "output_throughput": rate * 10}
    return probe


def test_goodput_brackets_the_capacity_within_the_resolution():
    calls: list[float] = []
    found = find_goodput(server_of_capacity(3.0, calls), Slo(), 1.0, SearchLimits(max_probes=10), math.inf)
    assert calls[:3] == [1.0, 2.0, 4.0]  # doubling until a rate misses
    assert found.stopped_by == "resolution"
    failing = min(p.rate for p in found.probes if p.misses)
    assert found.rate <= 3.0 < failing <= found.rate * 1.25
    assert found.at_rate["output_throughput"] == pytest.approx(found.rate * 10)


def test_goodput_search_is_bounded_by_probes_and_budget():
    calls: list[float] = []
    found = find_goodput(server_of_capacity(100.0, calls), Slo(), 1.0, SearchLimits(max_probes=3), math.inf)
    assert (calls, found.rate, found.stopped_by) == ([1.0, 2.0, 4.0], 4.0, "probes")
    found = find_goodput(server_of_capacity(100.0, calls := []), Slo(), 1.0, SearchLimits(), time.monotonic() - 1)
    assert (calls, found.stopped_by) == ([1.0], "budget")  # the first probe always runs


def test_no_rate_meeting_the_slo_is_goodput_zero():
    found = find_goodput(server_of_capacity(0.0, []), Slo(), 1.0, SearchLimits(max_probes=4), math.inf)
    assert found.rate == 0.0 and found.at_rate is None
    assert [p.rate for p in found.probes] == [1.0, 0.5, 0.25, 0.125]


def test_slo_names_what_a_probe_misses():
    summary = {"ttft": {"p90_ms": 2500.0}, "tpot": {"p90_ms": 50.0}}
    assert Slo(2000, 100).misses(summary) == ["TTFT p90 2500 ms > 2000"]
    assert Slo(3000, 40).misses(summary) == ["TPOT p90 50.0 ms > 40"]
    assert Slo(2000, 100).misses({"ttft": {}, "tpot": {}})  # no measurement is no pass


def test_static_batches_give_every_request_its_tokens_and_make_later_arrivals_wait(tiny_llama):
    from llmc.bench.static_batch import StaticBatchServer

    server = StaticBatchServer(str(tiny_llama), max_batch_size=2)
    prompts = ["memory bandwidth", "Every generated token", "reads all the weights", "so decoding is"]
    tokens = [len(server.tokenize(prompt)) for prompt in prompts]

    async def four_waiting_then_start() -> list[RequestResult]:
        requests = [asyncio.create_task(measure(server.stream(p, 6), RequestResult(n), None)) for p, n in zip(prompts, tokens)]
        await asyncio.sleep(0.2)  # all four queued before the model is free
        server.start()
        return await asyncio.gather(*requests)

    try:
        results = asyncio.run(four_waiting_then_start())
    finally:
        server.stop()
    assert [r.output_tokens for r in results] == [6] * 4
    # batches of two at most, in arrival order: the third and fourth wait for the whole first batch
    assert min(r.ttft for r in results[2:]) > max(r.latency for r in results[:2])
    per_token = server.kv_bytes_per_token
    assert per_token == 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 KV heads of 16 features, float32
    assert server.peak_kv_bytes <= 2 * (max(tokens) + 6) * per_token


def test_rungs_that_cannot_run_say_what_they_need(tiny_llama):
    rungs = {rung.name: rung for rung in plan_rungs(str(tiny_llama), RungArtifacts(), vllm=None)}
    assert list(rungs) == ["transformers", "llmc", "quantized", "fp8-kv", "draft"]
    assert "float32" in rungs["transformers"].configuration
    assert "--recipe" in rungs["quantized"].missing and "--fp8-kv" in rungs["fp8-kv"].missing
    assert "--draft" in rungs["draft"].missing
    with_vllm = plan_rungs(str(tiny_llama), RungArtifacts(quantized="q", fp8_kv="f", draft="d"), vllm="vllm")
    named = {rung.name: rung for rung in with_vllm}
    assert (named["draft"].model, named["draft"].speculative) == ("f", "d")
    assert (named["vllm"].model, named["vllm-quantized"].model) == (str(tiny_llama), "q")


def test_ladder_options_are_refused_where_they_do_not_apply(tmp_path):
    refused = llmc_in_process("bench", "smollm2-135m", "--ladder", "--url", "http://127.0.0.1:1")
    assert refused.returncode != 0 and "--url: not with --ladder" in refused.stderr
    refused = llmc_in_process("bench", "smollm2-135m", "--dataset", str(BUSINESS), "--recipe", "r.yaml")
    assert refused.returncode != 0 and "--recipe: only with --ladder" in refused.stderr
    refused = llmc_in_process("bench", "smollm2-135m")
    assert refused.returncode != 0 and "--dataset: required" in refused.stderr
    not_business = tmp_path / "prompts.jsonl"
    not_business.write_text(json.dumps({"prompt": "hello"}) + "\n")
    refused = llmc_in_process("bench", "smollm2-135m", "--ladder", "--dataset", str(not_business), "--out", str(tmp_path / "o"))
    assert refused.returncode != 0 and "business set" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "o").exists()  # nothing written before the inputs are resolved


def test_the_ladder_end_to_end_on_a_tiny_model(tmp_path, tiny_llama, calib_file, trained):
    w4a16 = "  - type: rtn\n    scheme: W4A16\n    weights:\n      group_size: 32\n"
    recipe = write_recipe(tmp_path / "w4.yaml", tiny_llama, tmp_path / "unused", w4a16, calib_file)
    out = tmp_path / "ladder"
    args = ("bench", str(tiny_llama), "--ladder", "--recipe", str(recipe), "--dataset", str(BUSINESS), "--num-prompts", "3",
            "--max-tokens", "4", "--max-probes", "2", "--probe-seconds", "1", "--budget-s", "30", "--quality-items", "2",
            "--draft", str(trained[0]), "--vllm", "off", "--out", str(out), "--json", str(tmp_path / "ladder.json"))
    run = llmc_in_process(*args)
    assert run.returncode == 0, run.stderr
    report = json.loads((tmp_path / "ladder.json").read_text())
    assert report == json.loads((out / "ladder.json").read_text())
    rungs = {rung["name"]: rung for rung in report["rungs"]}
    assert list(rungs) == ["transformers", "llmc", "quantized", "fp8-kv", "draft"]
    for name in ("transformers", "llmc", "quantized", "fp8-kv", "draft"):
        rung = rungs[name]
        assert rung["error"] is None and rung["probes"], name
        assert rung["goodput"] is not None and rung["weights_bytes"] > 0 and rung["kv_bytes"] > 0
        assert rung["quality"]["kl"] >= 0.0  # (recovery is None here: the random model scores 0 on the set)
    assert rungs["quantized"]["weights_bytes"] < rungs["llmc"]["weights_bytes"]  # int4 against float32
    assert json.loads((out / "artifacts" / "fp8-kv" / "llmc.json").read_text())["kv_cache"]["dtype"] == "fp8"
    assert rungs["llmc"]["quality"] == {"recovery": 1.0, "agreement": 1.0, "kl": 0.0}
    assert rungs["draft"]["rung"]["speculative"] == str(trained[0])
    assert rungs["draft"]["quality"] == rungs["fp8-kv"]["quality"]  # drafts verified greedily: the FP8 KV artifact's tokens
    assert (out / "ladder.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "artifacts" / "fp8-kv" / "config.json").is_file()
    again = llmc_in_process(*args)
    assert again.returncode != 0 and "--overwrite" in again.stderr


def test_the_chat_workload_keeps_each_items_system_prompt(tiny_llama):
    from transformers import AutoTokenizer

    from llmc.core.prompts import chat_workload

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    rows = [json.loads(line) for line in BUSINESS.read_text().splitlines() if line.strip()]
    prompts = chat_workload(BUSINESS, len(rows) + 2, tokenizer)
    assert prompts[0] == f"<system>{rows[0]['system']}\n<user>{rows[0]['prompt']}\n"
    assert prompts[len(rows):] == prompts[:2]  # reused in order past the end of the file
    assert len({rows[i]["system"] for i in range(len(rows))}) < len(rows) / 4  # shared system prompts: prefix caching has work


def test_the_ratio_to_a_baseline_that_met_the_slo_at_no_rate_is_a_lower_bound():
    from llmc.bench.ladder import Rung, RungResult
    from llmc.bench.ladder_report import ratio_to_baseline

    rung = Rung("r", "r", "llmc", "m")
    fast = RungResult(rung, goodput=2.0)
    assert ratio_to_baseline(fast, RungResult(rung, goodput=0.5)) == (4.0, False)
    assert ratio_to_baseline(fast, RungResult(rung, goodput=0.0, lowest_missed=0.25)) == (8.0, True)
    assert ratio_to_baseline(fast, RungResult(rung, error="failed")) == (None, False)
