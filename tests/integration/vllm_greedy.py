"""Greedy generation with vLLM, run by the python of vLLM's venv for test_vllm_compat.py and test_vllm_families.py (not a test itself).
argv: REQUEST RESULTS. REQUEST (JSON): {"artifacts", "prompts" (token id lists), "max_tokens", "max_model_len", "dtype"}.
RESULTS gets a JSON line per artifact: {"artifact", "token_ids", "generate_s"}, or {"artifact", "error"} when vLLM
cannot load or run it. vLLM's log goes to stdout and stderr, each artifact's part after a line `=== ARTIFACT`.
vLLM is imported once and each artifact runs in a child forked from that process: with VLLM_ENABLE_V1_MULTIPROCESSING=0
and the "uni" executor vLLM's engine runs in the child, so no engine or worker process is started per artifact."""
import gc
import json
import os
import sys
import time
import traceback


def generate(artifact: str, request: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(artifact, max_model_len=request["max_model_len"], max_num_seqs=len(request["prompts"]), dtype=request["dtype"],
              enforce_eager=True, distributed_executor_backend="uni", seed=0)
    try:
        params = SamplingParams(temperature=0, max_tokens=request["max_tokens"], ignore_eos=True)
        started = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params, use_tqdm=False)
        return {"token_ids": [list(output.outputs[0].token_ids) for output in outputs],
                "generate_s": round(time.perf_counter() - started, 1)}
    finally:
        del llm
        gc.collect()


def run_in_child(artifact: str, request: dict, results) -> None:
    """generate() in a child forked from this process, which has imported vLLM once: a load that fails half-way leaves
    vLLM's process state broken, and only the child's ends with it."""
    pid = os.fork()
    if pid == 0:
        try:
            result = generate(artifact, request)
        except Exception as error:
            traceback.print_exc()
            result = {"error": f"{type(error).__name__}: {error}"}
        results.write(json.dumps({"artifact": artifact} | result) + "\n")
        results.flush()
        sys.stderr.flush()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        results.write(json.dumps({"artifact": artifact, "error": f"vLLM's process ended with wait status {status}"}) + "\n")
        results.flush()


if __name__ == "__main__":
    from vllm import LLM, SamplingParams  # noqa: F401  (once, before the forks)
    from vllm.inputs import TokensPrompt  # noqa: F401

    request_path, results_path = sys.argv[1:]
    with open(request_path) as file:
        request = json.load(file)
    with open(results_path, "a") as results:
        for artifact in request["artifacts"]:
            print(f"=== {artifact}", file=sys.stderr, flush=True)
            run_in_child(artifact, request, results)
