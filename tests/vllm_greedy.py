"""Greedy generation with vLLM, run by the peer venv's python (tests/test_vllm_compat.py): reads
{"artifacts": [...], "prompts": [[token ids], ...], "max_tokens": N, "max_model_len": N, "dtype": D} on stdin and
prints one JSON line per artifact to stdout: {"artifact", "token_ids"} or {"artifact", "error"}. Each artifact's
log lines on stderr follow a line `=== ARTIFACT`."""
import gc
import json
import sys
import traceback


def generate(artifact: str, request: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(artifact, max_model_len=request["max_model_len"], max_num_seqs=len(request["prompts"]), dtype=request["dtype"],
              enforce_eager=True, seed=0)
    try:
        params = SamplingParams(temperature=0, max_tokens=request["max_tokens"], ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params, use_tqdm=False)
        return {"token_ids": [list(output.outputs[0].token_ids) for output in outputs]}
    finally:
        del llm
        gc.collect()


if __name__ == "__main__":
    request = json.load(sys.stdin)
    for artifact in request["artifacts"]:
        print(f"=== {artifact}", file=sys.stderr, flush=True)
        try:
            result = generate(artifact, request)
        except Exception as error:
            traceback.print_exc()
            result = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps({"artifact": artifact} | result), flush=True)
