"""lm-evaluation-harness offline: the llmc model wrapper on the shipped local task and on a user's task YAML."""
import json

import pytest
from conftest import llmc_serve, write_recipe
from lm_eval import simple_evaluate
from test_cli import llmc

from llmc.errors import LlmcError
from llmc.evals.lm_eval_model import resolve_tasks, run_lm_eval
from llmc.evals.loading import load_model
from llmc.pipeline import run_quantize
from llmc.recipe import load_recipe


def user_task(tmp_path):
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps({"q": q, "options": ["fox", "dog"], "gold": g}) + "\n"
                            for q, g in [("quick brown", 0), ("lazy", 1), ("the quick", 0)]))
    task = tmp_path / "my_task.yaml"
    task.write_text(f"""task: my_local_task
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{options}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
""")
    return task


def test_wrapper_runs_the_shipped_task_and_a_user_yaml_offline(tmp_path, tiny_llama):
    results = run_lm_eval(load_model(str(tiny_llama)), ["llmc_customer_service_mc", str(user_task(tmp_path))], limit=3)
    assert set(results) == {"llmc_customer_service_mc", "my_local_task"}
    for metrics in results.values():
        assert 0.0 <= metrics["acc"]["value"] <= 1.0 and metrics["acc"]["higher_is_better"] is True
    assert "acc_norm" in results["llmc_customer_service_mc"]


@pytest.mark.slow
def test_cli_tasks_with_limit_compare_targets_by_recovery(tmp_path, tiny_llama):
    run = llmc("eval", str(tiny_llama), str(tiny_llama), "--tasks", "llmc_customer_service_mc", "--limit", "2", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    other = report["targets"][f"{tiny_llama}#2"]
    base_acc = report["targets"][str(tiny_llama)]["lm_eval"]["llmc_customer_service_mc"]["acc"]["value"]
    assert other["vs_baseline"]["task_recovery"]["llmc_customer_service_mc/acc"] == (1.0 if base_acc else None)


@pytest.mark.slow
def test_unknown_task_is_a_clear_error():
    with pytest.raises(LlmcError, match="unknown lm-eval task 'no_such_task'"):
        resolve_tasks(["no_such_task"])


@pytest.mark.slow
def test_lm_eval_local_completions_against_llmc_serve_scores_like_llmc_eval(tmp_path, tiny_llama):
    """lm-eval's OpenAI-completions client scores each option from the echoed prompt's logprobs (echo, logprobs 1,
    max_tokens 1): against llmc serve it must agree with llmc eval's in-process run on the same artifact."""
    stage = "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n"
    artifact = run_quantize(load_recipe(write_recipe(tmp_path / "recipe.yaml", tiny_llama, tmp_path / "artifact", stage)))
    task = "llmc_customer_service_mc"
    run = llmc("eval", str(artifact), "--tasks", task, "--json")
    assert run.returncode == 0, run.stderr
    in_process = json.loads(run.stdout)["targets"][str(artifact)]["lm_eval"][task]["acc"]["value"]
    tasks, manager = resolve_tasks([task])
    with llmc_serve(artifact, "--dtype", "float32", "--served-model-name", "tiny") as (_, base):
        model_args = (f"base_url={base}/v1/completions,model=tiny,tokenizer={artifact},tokenizer_backend=huggingface,"
                      "num_concurrent=4,max_retries=1")
        output = simple_evaluate(model="local-completions", model_args=model_args, tasks=tasks, task_manager=manager,
                                 log_samples=False, bootstrap_iters=0)
    served, num_items = output["results"][task]["acc,none"], output["n-samples"][task]["effective"]
    print(f"{task}: llmc eval in-process acc {in_process:.4f}, lm-eval local-completions against llmc serve acc {served:.4f} "
          f"({num_items} items)")
    assert num_items > 10 and abs(served - in_process) * num_items <= 1 + 1e-9
