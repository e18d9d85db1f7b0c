"""The README as a new user meets it: its method table is the registry's, every Python block in
it runs as pasted, and CI runs the test command it gives."""

import re
from pathlib import Path

import pytest

from effattn.cli.methods import capability_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.M | re.S)


def test_readme_method_table_matches_the_registry():
    assert capability_table() in README.read_text(), (
        "README.md's method table is stale: regenerate it from `effattn methods`"
    )


def test_readme_is_a_front_page():
    assert len(README.read_text().splitlines()) <= 250
    assert len(blocks("python")) == 3  # the quickstart: functional, torch model, Hugging Face


@pytest.mark.parametrize("index", range(3))
def test_readme_python_block_runs(index, one_thread):
    """Each Python block runs in a fresh namespace, as a new user would paste it."""
    code = blocks("python")[index]
    if "transformers" in code:
        pytest.importorskip("transformers")
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(code, f"README.md (Python block {index + 1})", "exec"), namespace)
    if index == 0:
        assert namespace["out_t"].shape == (2, 8, 1, 64)
    if index == 2:
        assert namespace["out"].shape[0] == 1 and 8 < namespace["out"].shape[1] <= 8 + 32


def test_ci_runs_the_readme_test_command():
    """`.ci/run` ends with the test command the README's Test section gives."""
    section = README.read_text().split("## Test\n", 1)[1]
    command = re.search(r"```bash\n(.*?)\n```", section, re.S).group(1).strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert command.replace("python ", "python3 ") in ci or command in ci, command
