"""lm-evaluation-harness through llmc: the model `llmc` (registered with lm-eval) loads any llmc target,
artifacts included; tasks come from lm-eval, from llmc's own local tasks, or from YAML files the user names."""
import logging
import tempfile
import weakref
from pathlib import Path

from lm_eval import simple_evaluate
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from llmc.core.errors import LlmcError
from llmc.evals.loading import LoadedModel, load_model
from llmc.evals.task_yaml import check_task_code, task_name

LOCAL_TASKS = Path(__file__).parent / "tasks"


@register_model("llmc")
class LlmcLM(HFLM):
    """`lm_eval --model llmc --model_args target=ARTIFACT_OR_MODEL` once llmc is imported."""

    def __init__(self, target: str | LoadedModel, batch_size: int = 8, **kwargs):
        loaded = target if isinstance(target, LoadedModel) else load_model(target)
        super().__init__(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=int(batch_size), **kwargs)


def resolve_tasks(names: list[str], allow_code: bool = False) -> tuple[list[str], TaskManager]:
    """Task names, plus a manager that also sees llmc's tasks and each task YAML file named in `names` (that file
    alone, not its folder). A user's YAML with `!function` tags (code lm-eval would run) needs allow_code."""
    tasks, user_files = [], []
    for name in names:
        path = Path(name).expanduser()
        if path.suffix in (".yaml", ".yml") and path.is_file():
            check_task_code(path, allow_code)
            user_files.append(path)
            tasks.append(task_name(path))
        else:
            tasks.append(name)
    folder = index_folder(user_files) if user_files else None
    include = [str(LOCAL_TASKS), *([folder.name] if folder else [])]
    manager = TaskManager(include_path=include, include_defaults=False)
    if not set(tasks) <= set(manager.all_tasks):  # indexing lm-eval's own catalogue takes tens of seconds
        manager = TaskManager(include_path=include)
    if folder:
        weakref.finalize(manager, folder.cleanup)  # the manager reads the YAML again when it loads the task
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise LlmcError(f"unknown lm-eval task {unknown[0]!r}: not an lm-eval task, not in {LOCAL_TASKS}, not a task YAML file")
    return tasks, manager


def index_folder(files: list[Path]) -> tempfile.TemporaryDirectory:
    """A private folder holding a link to each file, for lm-eval to index instead of the files' folders (it indexes
    every *.yaml under a folder). lm-eval resolves the link, so `!function` and `include:` still look beside the file."""
    folder = tempfile.TemporaryDirectory(prefix="llmc-tasks-")
    for index, path in enumerate(files):
        (Path(folder.name) / f"{index}-{path.stem}.yaml").symlink_to(path.resolve())
    return folder


def run_lm_eval(loaded: LoadedModel, names: list[str], limit: float | None = None,
                resolved: tuple[list[str], TaskManager] | None = None) -> dict:
    """{task: {metric: value}} and which metrics are better when higher, for recovery. resolved: resolve_tasks(names)
    when the caller has it already."""
    tasks, manager = resolved or resolve_tasks(names)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    output = simple_evaluate(model=LlmcLM(loaded), tasks=tasks, limit=limit, task_manager=manager,
                             log_samples=False, bootstrap_iters=0)
    results = {}
    for task, metrics in output["results"].items():
        better = output.get("higher_is_better", {}).get(task, {})
        results[task] = {
            key.split(",")[0]: {"value": value, "higher_is_better": better.get(key.split(",")[0], True)}
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and "_stderr" not in key
        }
    return results
