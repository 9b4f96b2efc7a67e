"""Every script in benchmarks/ imports: most need a GPU, vLLM or minutes to run, so this is what CI can hold them to
(one had imported a constant from the module it used to live in)."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_every_benchmark_script_imports():
    modules = sorted(path.stem for path in (REPO / "benchmarks").glob("*.py"))
    assert "speculative_step_costs" in modules
    env = os.environ | {"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'benchmarks'}"}
    result = subprocess.run([sys.executable, "-c", "import importlib, sys\nfor name in sys.argv[1:]: importlib.import_module(name)",
                             *modules], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
