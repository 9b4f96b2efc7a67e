"""The README and docs/ show commands and recipes people copy: every `llmc SUBCOMMAND --option` they show must be an
option of that command, and every recipe they show must load with llmc's own recipe parser. Docs drift silently when
an option is renamed; this test makes the rename fail here instead of on a reader's machine."""
import re
from pathlib import Path

import pytest
import yaml

from llmc.cli import cli
from llmc.core.errors import LlmcError
from llmc.pipeline.recipe import TRANSFORM_STAGES, load_recipe

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`]+)`")
# `llmc` as the command a shell segment runs (not an argument, as in `ruff check llmc tests`), or run by
# `python -m llmc` / `torchrun ... -m llmc`, after any VAR=value assignments
COMMAND = re.compile(r"^\s*(?:\w+=\S*\s+)*(?:(?:python[\d.]*|torchrun\b[^;&|]*?)\s+-m\s+)?llmc[ \t]+([a-z][a-z0-9-]*)(.*)")
OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
TRANSFORM_TYPES = {stage.model_fields["type"].annotation.__args__[0] for stage in TRANSFORM_STAGES}


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block."""
    return [(lang, body) for lang, body in FENCE.findall(text)]


def command_lines(text: str) -> list[str]:
    """Every shell line of the fenced blocks (continuations joined; an indented `[--option ...]` line, as in a usage
    synopsis, continues the line above) and every inline code span, which prose uses for commands too."""
    lines = []
    for lang, body in code_blocks(text):
        if lang not in ("", "bash", "sh", "shell", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if lines and re.match(r"\s+\[", line):
                lines[-1] += " " + line.strip()
            else:
                lines.append(line)
    prose = FENCE.sub("", text)
    lines += [span.replace("\n", " ") for span in INLINE.findall(prose)]
    return lines


def unknown_options(text: str) -> list[str]:
    """Each `llmc COMMAND --option` in text whose command or option the CLI does not have."""
    problems = []
    for line in command_lines(text):
        for segment in re.split(r"&&|\|\||;|\|", line):
            match = COMMAND.match(segment)
            if not match:
                continue
            name, rest = match.groups()
            command = cli.commands.get(name)
            if command is None:
                problems.append(f"`llmc {name}`: no such command ({segment.strip()})")
                continue
            rest = re.split(r"(?:^|\s)--(?:\s|$)", rest)[0]  # after a lone `--`, options go to vLLM as they are
            known = {opt for param in command.params for opt in param.opts + param.secondary_opts} | {"--help"}
            for option in OPTION.findall(rest):
                option = option.split("=")[0]
                if option not in known:
                    problems.append(f"`llmc {name} {option}`: no such option ({segment.strip()})")
    return problems


def recipe_blocks(text: str) -> list[str]:
    """The YAML blocks that are recipes: a mapping with `model` and `stages` (or `quantization`)."""
    found = []
    for lang, body in code_blocks(text):
        if lang not in ("yaml", "yml", ""):
            continue
        try:
            data = yaml.safe_load(body)
        except yaml.YAMLError:
            continue
        if isinstance(data, dict) and "model" in data and ("stages" in data or "quantization" in data):
            found.append(body)
    return found


def load_shown_recipe(body: str, folder: Path):
    """The recipe as llmc's parser reads it. A reference block lists every stage type once, in the order the fields
    are explained, which puts AWQ and SmoothQuant after RTN and GPTQ; those are moved first (the order a recipe must
    use) so that every field and value is still checked."""
    path = folder / "recipe.yaml"
    path.write_text(body)
    try:
        return load_recipe(path)
    except LlmcError as error:
        if "must come before the stages that quantize" not in str(error):
            raise
    data = yaml.safe_load(body)
    data["stages"] = sorted(data["stages"], key=lambda stage: stage.get("type") not in TRANSFORM_TYPES)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_recipe(path)


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_llmc_command_and_option_shown_exists(doc):
    assert unknown_options(doc.read_text()) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_recipe_shown_loads(doc, tmp_path):
    for body in recipe_blocks(doc.read_text()):
        load_shown_recipe(body, tmp_path)


def test_the_docs_show_commands_and_a_recipe():
    """The checks above pass vacuously if the parsing finds nothing: it must find the README's commands and the
    reference recipe."""
    readme = (ROOT / "README.md").read_text()
    shown = {COMMAND.match(segment).group(1) for line in command_lines(readme) for segment in re.split(r"&&|;", line)
             if COMMAND.match(segment)}
    assert {"quantize", "eval", "serve", "bench", "train-draft", "inspect"} <= shown
    assert recipe_blocks((ROOT / "docs" / "recipes.md").read_text())


def test_a_made_up_option_or_command_is_caught():
    text = ("```bash\nllmc serve artifacts/x --no-such-option 1 -- --tensor-parallel-size 8\n"
            "llmc quantize recipe.yaml \\\n    --overwrite --also-made-up\n"
            "llmc frobnicate x\n```\n"
            "Prose with `llmc eval A B\n--not-an-eval-option` and `llmc serve --engine vllm X -- --vllm-only-flag`.\n")
    problems = unknown_options(text)
    assert len(problems) == 4, problems
    assert any("--no-such-option" in problem for problem in problems)
    assert any("--also-made-up" in problem for problem in problems)
    assert any("frobnicate" in problem for problem in problems)
    assert any("--not-an-eval-option" in problem for problem in problems)


def test_a_made_up_recipe_field_is_caught(tmp_path):
    body = "model: smollm2-135m\noutput: artifacts/x\nstages:\n  - type: rtn\n    scheme: W4A16\n    no_such_field: 1\n"
    assert recipe_blocks(f"```yaml\n{body}```\n")
    with pytest.raises(LlmcError, match="no_such_field"):
        load_shown_recipe(body, tmp_path)


def anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of a markdown file: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", FENCE.sub("", text), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_link_between_the_docs_resolves(doc):
    """Moving text between files breaks links silently; each relative link must name a file and a heading there."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", doc.read_text())):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(target)
    assert broken == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_code_block_is_closed(doc):
    """A fence left open (or doubled) when text is cut turns the prose after it into code, and hides it from the checks
    above, which read commands from code blocks and prose apart."""
    fences = [line for line in doc.read_text().splitlines() if line.startswith("```")]
    assert len(fences) % 2 == 0 and all(line == "```" for line in fences[1::2]), fences
