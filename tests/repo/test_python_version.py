"""The Python the package claims (pyproject's requires-python) is the one CI checks (.ci/run's MIN_PYTHON) and the one
the README's install lines name, and the interpreter running the tests satisfies it."""
import os
import platform
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
CI_RUN = ROOT / ".ci" / "run"


def required_python() -> SpecifierSet:
    return SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])


def ci_minimum() -> str:
    match = re.search(r"^MIN_PYTHON=([0-9.]+)$", CI_RUN.read_text(), re.MULTILINE)
    assert match, ".ci/run sets no MIN_PYTHON"
    return match.group(1)


def test_the_running_python_satisfies_the_claim_and_ci_and_readme_say_the_same_minimum():
    assert required_python().contains(platform.python_version()), (required_python(), platform.python_version())
    assert required_python() == SpecifierSet(f">={ci_minimum()}")
    readme = (ROOT / "README.md").read_text()
    assert f"Python {ci_minimum()} or newer" in readme and f"python{ci_minimum()} -m venv" in readme


def python_reporting(folder: Path, version: tuple[int, int, int]) -> Path:
    """A stand-in interpreter: the real one with sys.version_info set to version for `-c`, a note of any other call."""
    fake = folder / "python"
    fake.write_text(f"""#!/bin/sh
if [ "$1" = -c ]; then exec {sys.executable} -c "import sys; sys.version_info = {version}
$2"; fi
if [ "$1" = --version ]; then echo "Python {'.'.join(map(str, version))}"; exit 0; fi
echo "$@" > "{folder}/called"; exit 3
""")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return fake


@pytest.mark.parametrize("version, accepted", [((3, 10, 14), False), ((3, 11, 0), True), ((3, 13, 1), True)])
def test_ci_refuses_a_python_older_than_the_claim_with_a_clear_message(tmp_path, version, accepted):
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "run").write_text(CI_RUN.read_text())  # a copy: it changes into its checkout and builds a venv there
    run = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True,
                         env=os.environ | {"PYTHON": str(python_reporting(tmp_path, version))})
    if accepted:  # past the check, .ci/run builds its venv with that same interpreter
        assert run.returncode == 3 and (tmp_path / "called").read_text().split() == ["-m", "venv", ".venv"], run.stderr
    else:
        assert run.returncode == 1 and not (tmp_path / "called").exists()
        assert f"llmc needs Python >= {ci_minimum()}, but" in run.stderr and "Python 3.10.14" in run.stderr
