"""The README's method table is the registry's: it cannot drift from what the code promises."""

from pathlib import Path

from effattn.cli.methods import capability_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_method_table_matches_the_registry():
    assert capability_table() in README.read_text(), (
        "README.md's method table is stale: regenerate it from `effattn methods`"
    )


def test_readme_usage_example_runs():
    """The README's Python example, as a new user would paste it."""
    text = README.read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start:text.index("```", start)]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    out_t, state = namespace["out_t"], namespace["state"]
    assert out_t.shape == (2, 8, 1, 64) and state.position == 4097
