"""lm-eval both ways on one artifact: `llmc eval --tasks` in-process (transformers on the dequantized weights) and
lm-eval's `local-completions` model against `llmc serve` (the runtime, through echo and prompt logprobs).
usage: python benchmarks/lm_eval_served.py ARTIFACT [--task llmc_customer_service_mc] [--port 8011]"""
import argparse
import json
import os
import subprocess
import sys
import time

import httpx
from lm_eval import simple_evaluate

from llmc.evals.lm_eval_model import resolve_tasks


def in_process_accuracy(artifact: str, task: str) -> float:
    run = subprocess.run([sys.executable, "-m", "llmc", "eval", artifact, "--tasks", task, "--json"], capture_output=True, text=True,
                         check=True)
    return json.loads(run.stdout)["targets"][artifact]["lm_eval"][task]["acc"]["value"]


def served_accuracy(artifact: str, task: str, port: int) -> tuple[float, int]:
    server = subprocess.Popen([sys.executable, "-m", "llmc", "serve", artifact, "--port", str(port), "--served-model-name", "served"],
                              env=os.environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            assert server.poll() is None, "llmc serve exited"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.ConnectError:
                time.sleep(0.5)
        tasks, manager = resolve_tasks([task])
        model_args = (f"base_url=http://127.0.0.1:{port}/v1/completions,model=served,tokenizer={artifact},"
                      "tokenizer_backend=huggingface,num_concurrent=8")
        output = simple_evaluate(model="local-completions", model_args=model_args, tasks=tasks, task_manager=manager,
                                 log_samples=False, bootstrap_iters=0)
        return output["results"][task]["acc,none"], output["n-samples"][task]["effective"]
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--task", default="llmc_customer_service_mc")
    parser.add_argument("--port", type=int, default=8011)
    args = parser.parse_args()
    in_process = in_process_accuracy(args.artifact, args.task)
    served, num_items = served_accuracy(args.artifact, args.task, args.port)
    print(f"{args.task} on {args.artifact} ({num_items} items): llmc eval in-process acc {in_process:.4f} "
          f"({round(in_process * num_items)}/{num_items}); lm-eval local-completions against llmc serve acc {served:.4f} "
          f"({round(served * num_items)}/{num_items})")


if __name__ == "__main__":
    main()
