"""Greedy generation with vLLM, run by the python of vLLM's venv for test_vllm_compat.py and test_vllm_families.py (not a test itself).
argv: REQUEST RESULTS. REQUEST (JSON): {"artifacts", "prompts" (token id lists), "max_tokens", "max_model_len", "dtype"}.
RESULTS gets a JSON line per artifact: {"artifact", "token_ids", "generate_s"}, or {"artifact", "error"} when vLLM
cannot load or run it. vLLM's log goes to stdout and stderr, each artifact's part after a line `=== ARTIFACT`.
The artifacts share one process (a new one after an artifact fails): with VLLM_ENABLE_V1_MULTIPROCESSING=0 and the
"uni" executor vLLM's engine runs in it, so no engine or worker process is started per artifact."""
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


if __name__ == "__main__":
    request_path, results_path = sys.argv[1:]
    with open(request_path) as file:
        request = json.load(file)
    with open(results_path, "a") as results:
        for index, artifact in enumerate(request["artifacts"]):
            print(f"=== {artifact}", file=sys.stderr, flush=True)
            try:
                result = generate(artifact, request)
            except Exception as error:
                traceback.print_exc()
                result = {"error": f"{type(error).__name__}: {error}"}
            results.write(json.dumps({"artifact": artifact} | result) + "\n")
            results.flush()
            remaining = request["artifacts"][index + 1 :]
            if "error" in result and remaining:
                # a load that failed half-way leaves vLLM's process state broken for the next one: go on in a new process
                with open(request_path, "w") as file:
                    json.dump(request | {"artifacts": remaining}, file)
                os.execv(sys.executable, [sys.executable, __file__, request_path, results_path])
