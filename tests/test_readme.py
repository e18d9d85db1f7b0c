"""The README's method table is the registry's: it cannot drift from what the code promises."""

from pathlib import Path

from effattn.cli_methods import capability_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_method_table_matches_the_registry():
    assert capability_table() in README.read_text(), (
        "README.md's method table is stale: regenerate it from `effattn methods`"
    )
