"""Imports run one way: no llmc subpackage or top-level module imports one that imports it back, directly or
through others; inside the runtime the same holds between its sub-packages."""
import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "llmc"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every llmc module `path` imports, at the top or inside a function."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            found.add(".".join(base + ([node.module] if node.module else [])))
    return {name for name in found if name == "llmc" or name.startswith("llmc.")}


def import_graph(depth: int, within: str = "llmc") -> dict[str, set[str]]:
    """Edges between units: module names cut to `depth` parts (2: llmc.quant, llmc.cli), for modules under `within`."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        source = module_name(path)
        if not source.startswith(within + "."):
            continue
        unit = ".".join(source.split(".")[:depth])
        for target in imported_modules(path):
            target_unit = ".".join(target.split(".")[:depth])
            if target.startswith(within + ".") and target_unit != unit:
                graph[unit].add(target_unit)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for successor in sorted(graph.get(node, ())):
            if state.get(successor) == "open":
                return stack[stack.index(successor):] + [successor]
            if successor not in state and (cycle := visit(successor)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_subpackages_and_top_level_modules_import_one_way():
    cycle = find_cycle(import_graph(depth=2))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_runtime_subpackages_import_one_way():
    cycle = find_cycle(import_graph(depth=3, within="llmc.runtime"))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_low_packages_import_nothing_above_them():
    graph = import_graph(depth=2)
    assert not graph["llmc.core"], "core imports nothing else of llmc"
    assert graph["llmc.checkpoints"] <= {"llmc.core"}
    assert graph["llmc.quant"] <= {"llmc.core", "llmc.checkpoints"}
    assert graph["llmc.external"] <= {"llmc.core", "llmc.checkpoints"}
    assert not graph["llmc.runtime"] & {"llmc.draft", "llmc.evals", "llmc.calib", "llmc.pipeline", "llmc.cli"}
    assert not {unit for unit, targets in graph.items() if "llmc.pipeline" in targets} - {"llmc.cli", "llmc.tune"}, \
        "only the CLI and the tune (which runs it many times) run the pipeline"


def test_the_root_holds_only_the_public_surface():
    assert sorted(path.name for path in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py", "cli.py"]
    assert sorted(path.name for path in (PACKAGE / "runtime").glob("*.py")) == ["__init__.py", "llm.py", "sampling_params.py"]


def test_no_two_modules_share_a_name_unless_they_are_the_same_concept_in_parallel_places():
    parallel = {"__init__.py", "config.py", "data.py", "eagle3.py", "moe.py"}  # each package's config, data, EAGLE-3, MoE
    names = [path.name for path in PACKAGE.rglob("*.py")]
    assert sorted({name for name in names if names.count(name) > 1} - parallel) == []


def test_the_engine_core_does_not_import_the_drafts():
    graph = import_graph(depth=3, within="llmc.runtime")
    assert "llmc.runtime.speculative" not in graph["llmc.runtime.engine"]
