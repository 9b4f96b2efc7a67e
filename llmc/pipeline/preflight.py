"""What a recipe names besides the model, resolved before the heavy work (and its heavy imports) start: a missing
or unreachable input stops `llmc quantize` within seconds, with the field and YAML line that named it."""
from collections.abc import Callable
from pathlib import Path

from llmc.artifact.writer import settle_kept_staging
from llmc.core.device import resolve_device
from llmc.core.errors import LlmcError
from llmc.core.prompts import check_prompt_files
from llmc.core.staging import check_output
from llmc.evals.inputs import EvalInputs, check_tasks, load_business_items, load_perplexity_text
from llmc.pipeline.recipe import Recipe


def resolved(recipe: Recipe, location: tuple, load: Callable):
    """load(), or its LlmcError said of the recipe field at location, with the field's YAML line."""
    try:
        return load()
    except LlmcError as error:
        raise recipe.field_error(location, error) from None


def resolve_eval_and_draft_inputs(recipe: Recipe, overwrite: bool, resume: bool = False, discard_partial: bool = False) -> EvalInputs:
    """The output folder (and the work earlier runs of it kept) and the device checked, then the eval data sets and tasks
    and the draft prompt files: everything the recipe names besides the model and the calibration set (which needs the
    model's tokenizer)."""
    check_output(Path(recipe.output), overwrite)
    settle_kept_staging(Path(recipe.output), resume, discard_partial)
    resolved(recipe, ("device",), lambda: resolve_device(recipe.device))
    settings = recipe.eval
    inputs = EvalInputs(resolved(recipe, ("eval", "perplexity", "dataset"), lambda: load_perplexity_text(settings)),
                        resolved(recipe, ("eval", "business", "dataset"), lambda: load_business_items(settings)),
                        resolved(recipe, ("eval", "tasks", "names"), lambda: check_tasks(settings)))
    if recipe.draft is not None:
        resolved(recipe, ("draft", "prompts"), lambda: check_prompt_files(recipe.draft.prompts))
    return inputs
