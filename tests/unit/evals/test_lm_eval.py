"""lm-evaluation-harness offline: the llmc model wrapper on the shipped local task and on a user's task YAML."""
import json
import re

import pytest
from helpers import llmc_in_process, llmc_process, llmc_serve, write_recipe
from lm_eval import simple_evaluate

from llmc.core.errors import LlmcError
from llmc.evals.config import options_eval_config
from llmc.evals.lm_eval_model import resolve_tasks, run_lm_eval
from llmc.evals.loading import load_model
from llmc.pipeline.preflight import resolve_eval_and_draft_inputs
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe


def user_task(tmp_path, name: str = "my_local_task", extra: str = ""):
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps({"q": q, "options": ["fox", "dog"], "gold": g}) + "\n"
                            for q, g in [("quick brown", 0), ("lazy", 1), ("the quick", 0)]))
    task = tmp_path / f"{name}.yaml"
    task.write_text(f"""task: {name}
{extra}dataset_path: json
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


def task_with_code(folder):
    """A task YAML whose process_docs is a function in helpers.py beside it; importing helpers leaves a marker file."""
    (folder / "helpers.py").write_text("from pathlib import Path\n\nPath(__file__).with_name('helpers-imported').touch()\n\n\n"
                                       "def first_two(dataset):\n    return dataset.select(range(2))\n")
    return user_task(folder, "coded_task", extra="process_docs: !function helpers.first_two\n")


def test_a_task_yaml_that_runs_code_is_refused_without_the_flag_and_runs_with_it(tmp_path, tiny_llama):
    task = task_with_code(tmp_path)
    with pytest.raises(LlmcError, match=rf"{re.escape(str(task))}, line 2: `!function helpers.first_two` .* --allow-task-code"):
        resolve_tasks([str(task)])
    assert not (tmp_path / "helpers-imported").exists()
    resolved = resolve_tasks([str(task)], allow_code=True)
    results = run_lm_eval(load_model(str(tiny_llama)), [str(task)], resolved=resolved)
    assert (tmp_path / "helpers-imported").exists() and 0.0 <= results["coded_task"]["acc"]["value"] <= 1.0


def test_llmc_eval_refuses_task_code_before_loading_any_model(tmp_path):
    task = task_with_code(tmp_path)
    run = llmc_in_process("eval", str(tmp_path / "no-model-needed"), "--tasks", str(task))
    assert run.returncode != 0 and f"{task}, line 2: `!function helpers.first_two`" in run.stderr and "--allow-task-code" in run.stderr
    assert not (tmp_path / "helpers-imported").exists()


def test_a_recipe_names_the_flag_as_its_own_field(tmp_path, tiny_llama):
    task = task_with_code(tmp_path)
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_llama, tmp_path / "artifact", "  - type: rtn\n    scheme: W4A16\n")
    base = recipe.read_text()
    recipe.write_text(f"{base}eval:\n  tasks:\n    names: [{task}]\n")
    with pytest.raises(LlmcError, match="eval.tasks.names.*line 2.*--allow-task-code.*eval.tasks.allow_code: true"):
        resolve_eval_and_draft_inputs(load_recipe(recipe), overwrite=False)
    recipe.write_text(f"{base}eval:\n  tasks:\n    names: [{task}]\n    allow_code: true\n")
    assert resolve_eval_and_draft_inputs(load_recipe(recipe), overwrite=False).tasks[0] == ["coded_task"]
    with pytest.raises(LlmcError, match="--allow-task-code .* goes with --tasks"):
        options_eval_config(None, 1024, 40, "business.jsonl", None, None, [], allow_task_code=True)


def test_only_the_named_task_file_is_indexed_not_its_folder(tmp_path):
    task = user_task(tmp_path)
    user_task(tmp_path, "sibling_task")
    (tmp_path / "nested").mkdir()
    user_task(tmp_path / "nested", "nested_task")
    tasks, manager = resolve_tasks([str(task)])
    assert tasks == ["my_local_task"] and "my_local_task" in manager.all_tasks
    assert not {"sibling_task", "nested_task"} & set(manager.all_tasks)
    assert "llmc_customer_service_mc" in manager.all_tasks  # the bundled task (its !function trusted) is still there
    yml = user_task(tmp_path / "nested", "yml_task").rename(tmp_path / "nested" / "yml_task.yml")
    assert "yml_task" in resolve_tasks([str(yml)])[1].all_tasks  # lm-eval itself indexes *.yaml only


def test_included_files_are_checked_for_code_and_must_exist(tmp_path):
    task_with_code(tmp_path)
    including = tmp_path / "including.yaml"
    including.write_text("include: coded_task.yaml\ntask: including_task\n")
    with pytest.raises(LlmcError, match=rf"{re.escape(str(tmp_path / 'coded_task.yaml'))}, line 2: `!function helpers.first_two`"):
        resolve_tasks([str(including)])
    tasks, manager = resolve_tasks([str(including)], allow_code=True)
    assert tasks == ["including_task"] and "including_task" in manager.all_tasks and "coded_task" not in manager.all_tasks
    including.write_text("task: including_task\ninclude: [missing.yaml]\n")
    with pytest.raises(LlmcError, match=rf"{re.escape(str(including))}, line 2: `include: missing.yaml`: no such file"):
        resolve_tasks([str(including)], allow_code=True)
    assert not (tmp_path / "helpers-imported").exists()  # checking and indexing never import the helpers


@pytest.mark.slow
def test_cli_tasks_with_limit_compare_targets_by_recovery(tmp_path, tiny_llama):
    run = llmc_process("eval", str(tiny_llama), str(tiny_llama), "--tasks", "llmc_customer_service_mc", "--limit", "2", "--json")
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
    run = llmc_process("eval", str(artifact), "--tasks", task, "--json")
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
