"""`llmc bench --ladder --recipe`: the quantized rungs' artifacts from one recipe: its weights alone (no KV cache
section, no draft), and its weights with an FP8 KV cache and the recipe's draft heads, when it has a draft section (the
draft rung serves that artifact with them, the FP8 rung without). Written under OUT/artifacts; a complete artifact
left by an earlier run is reused."""
from pathlib import Path

from rich.console import Console

from llmc.core.errors import LlmcError
from llmc.evals.config import EvalConfig
from llmc.pipeline.recipe import Recipe, load_recipe


def ladder_recipes(recipe_path: Path, model: str, folder: Path, console: Console) -> dict[str, Recipe]:
    """The two recipes, checked before any work: the model is the ladder's, the recipe's evals are left to the ladder."""
    given = load_recipe(recipe_path, [f"model={model}"])
    if given.eval != EvalConfig():
        console.print(f"{recipe_path.name}: its eval section is not run by the ladder (each rung's quality comes from the "
                      "ladder's own business-set comparison)")
    common = [f"model={model}", "eval={}"]
    recipes = {"quantized": load_recipe(recipe_path, [*common, "kv_cache=", "draft="], str(folder / "quantized"))}
    if given.calibration is None:
        raise LlmcError(f"--recipe {recipe_path}: the FP8 KV cache rung calibrates k/v scales, so the recipe needs a "
                        "calibration section (or give the rung's artifact with --fp8-kv DIR)")
    kv = [] if given.kv_cache is not None and given.kv_cache.dtype == "fp8" else ["kv_cache={dtype: fp8}"]
    recipes["fp8_kv"] = load_recipe(recipe_path, [*common, *kv], str(folder / "fp8-kv"))
    return recipes


def quantize_rungs(recipe_path: Path, model: str, folder: Path, console: Console) -> dict[str, str | None]:
    """The rungs' artifacts by RungArtifacts' field names (quantized, fp8_kv, draft)."""
    from llmc.pipeline.preflight import resolve_eval_and_draft_inputs
    from llmc.pipeline.quantize import run_quantize

    recipes = ladder_recipes(recipe_path, model, folder, console)
    written = {}
    for name, recipe in recipes.items():
        output = Path(recipe.output)
        if (output / "llmc.json").is_file():
            console.print(f"reusing {output} (written by an earlier run)")
        else:
            console.print(f"quantizing {model} by {recipe_path.name} into {output}")
            run_quantize(recipe, eval_inputs=resolve_eval_and_draft_inputs(recipe, overwrite=False))
        written[name] = str(output)
    fp8 = Path(written["fp8_kv"])
    return written | {"draft": str(fp8) if (fp8 / "draft").is_dir() else None}
