"""`llmc eval --speculative --vllm PATH`: the same draft in vLLM. `vllm serve` (every core given to its model worker)
runs the artifact without and then with the draft exported to vLLM's layout, on the same prompt token ids as llmc's
measurement, greedy, one request at a time: vLLM's mean accepted length from its /metrics counters, its batch-1
tokens/s with and without the draft, and whether its outputs with the draft equal its own without."""
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmc.core.errors import LlmcError
from llmc.draft.vllm_export import NOT_EXPORTABLE, VLLM_DIR, VLLM_METHODS, export_for_vllm
from llmc.external.vllm_server import LOCAL_SERVED_NAME, find_vllm, local_vllm, vllm_model
from llmc.runtime.speculative.store import read_draft_config

MAX_MODEL_LEN = 2048  # the measured prompts and answers fit; a long-context model's own length would reserve far more KV


def served_length(model: str) -> int:
    """MAX_MODEL_LEN, or the model's own context where that is shorter (vLLM refuses a longer one)."""
    config = Path(model) / "config.json"
    own = json.loads(config.read_text()).get("max_position_embeddings") if config.is_file() else None
    return min(MAX_MODEL_LEN, own or MAX_MODEL_LEN)


def vllm_executable(path: str) -> str:
    """--vllm takes the venv vLLM is installed in or its `vllm` executable."""
    candidate = Path(path) / "bin" / "vllm"
    return find_vllm(str(candidate) if Path(path).is_dir() else path)


def check_vllm_inputs(draft: Path, vllm: str) -> None:
    """Before any work: vLLM is where --vllm says, and the draft is one vLLM serves."""
    vllm_executable(vllm)
    method = read_draft_config(draft)["method"]
    if method not in VLLM_METHODS:
        raise LlmcError(f"--vllm: {draft} holds a {method} draft, which vLLM cannot serve: {NOT_EXPORTABLE[method]}")


@contextmanager
def vllm_server(executable: str, model: str, extra: list[str], log: Path) -> Iterator[str]:
    """vLLM on the model, one request at a time, no prefix caching: the conditions of llmc's own measurement."""
    folder = vllm_model(model)
    flags = ["--dtype", "bfloat16", "--max-num-seqs", "1", "--no-enable-prefix-caching", "--max-model-len",
             str(served_length(folder)), *extra]
    with local_vllm(executable, folder, flags, log) as url:
        yield url


def generate(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Each prompt's greedy token ids, one request at a time, and the seconds they took (after one warm-up request)."""
    def complete(prompt: list[int], tokens: int) -> list[int]:
        body = {"model": LOCAL_SERVED_NAME, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "return_token_ids": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        return response.json()["choices"][0]["token_ids"]

    complete(prompts[0], 8)
    started = time.perf_counter()
    outputs = [complete(prompt, max_tokens) for prompt in prompts]
    return outputs, time.perf_counter() - started


def spec_counters(url: str) -> dict[str, float]:
    """vLLM's speculative counters: drafts, draft tokens, accepted tokens, and accepted tokens per position."""
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            name = sample.name.removeprefix("vllm:spec_decode_").removesuffix("_total")
            if not sample.name.startswith("vllm:spec_decode_") or sample.name.endswith("_created"):
                continue
            key = f"{name}[{sample.labels['position']}]" if "position" in sample.labels else name
            counters[key] = counters.get(key, 0.0) + sample.value
    return counters


def vllm_speculative_eval(model: str, draft: Path, prompts: list[list[int]], max_tokens: int, num_speculative_tokens: int,
                          vllm: str, vllm_args: tuple[str, ...] = ()) -> dict:
    """vLLM's numbers for the draft in `draft` (its exported vllm/ folder, or an export made here) on these prompts,
    each `vllm serve` given `vllm_args` too; the servers' logs stay in a temporary folder the result names."""
    executable = vllm_executable(vllm)
    method = read_draft_config(draft)["method"]
    work = Path(tempfile.mkdtemp(prefix="llmc-vllm-eval-"))
    exported = draft / VLLM_DIR
    if not (exported / "config.json").is_file():
        exported = export_for_vllm(draft, work / VLLM_DIR)
    with vllm_server(executable, model, list(vllm_args), work / "plain.log") as url:
        plain, plain_s = generate(url, prompts, max_tokens)
    spec_config = {"method": VLLM_METHODS[method], "model": str(exported), "num_speculative_tokens": num_speculative_tokens}
    speculative_args = [*vllm_args, "--speculative-config", json.dumps(spec_config)]
    with vllm_server(executable, model, speculative_args, work / "speculative.log") as url:
        before = spec_counters(url)
        speculative, speculative_s = generate(url, prompts, max_tokens)
        after = spec_counters(url)  # minus the warm-up request's drafts
    counts = {key: after[key] - before.get(key, 0.0) for key in after}
    drafts = counts.get("num_drafts", 0.0)
    if not drafts:
        raise LlmcError(f"vLLM drafted nothing with {exported} (logs in {work})")
    plain_rate, speculative_rate = sum(map(len, plain)) / plain_s, sum(map(len, speculative)) / speculative_s
    return {
        "method": VLLM_METHODS[method], "num_speculative_tokens": num_speculative_tokens,
        "mean_accepted_length": 1 + counts["num_accepted_tokens"] / drafts,
        "acceptance_per_position": [counts.get(f"num_accepted_tokens_per_pos[{position}]", 0.0) / drafts
                                    for position in range(num_speculative_tokens)],
        "num_drafts": int(drafts), "identical_to_plain": sum(a == b for a, b in zip(plain, speculative)),
        "batch1": {"plain_tokens_per_s": plain_rate, "speculative_tokens_per_s": speculative_rate,
                   "speedup": speculative_rate / plain_rate},
        "outputs": speculative, "logs": str(work),
    }
