"""What users read speaks of the design and the measurements, never of how the work was
organised: no internal issue numbers, work sessions, stops or rounds in the README, the
changelog, docs/, the package's docstrings and comments, or examples/."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Phrases of a tracker or of the history of the work. Each is specific enough that legitimate
# text does not match it: "round r" of LSH hashing, "stop" as a verb or "issue" as a noun
# without a number stay allowed.
TRACKER = re.compile(
    r"\bissues? ?#?\d+"                          # issue 21, issue #21, issues 19
    r"|\b(?:PR|pull request|ticket) ?#?\d+"      # PR #3, ticket 12
    r"|\bstops? ?#?\d+\b|\bthis stop\b"          # stop 3, this stop's
    r"|\brounds? ?#?\d+\b"                       # round 2
    r"|\bsessions?\b"                            # this session added ...
    r"|\bwork items?\b",
    re.IGNORECASE,
)


def user_facing_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    for folder in ("src", "examples"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return [f for f in files if f.exists()]


def test_the_pattern_catches_tracker_words_and_spares_legitimate_text():
    for hit in ("as in issue 22", "issue #21's goal", "Issues 19 and 20", "before this stop's",
                "stop 3", "this session added", "Round 2 of the work", "a work item"):
        assert TRACKER.search(hit), hit
    for fine in ("in round r of the hashing", "count in this round", "stop = min(n, start + 64)",
                 "an issue of precision", "no early stop at EOS", "round(sqrt(N))",
                 "the caches stop growing at the window"):
        assert not TRACKER.search(fine), fine


def test_no_tracker_words_in_what_users_read():
    hits = []
    for path in user_facing_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = TRACKER.search(line)
            if match:
                hits.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}: "
                            f"{line.strip()[:120]}")
    assert not hits, "tracker or work-history words:\n" + "\n".join(hits)


def test_cpu_results_table_is_the_bench_folders():
    """docs/results/cpu.md's sweep table is what benchmarks/readme_table.py prints from
    benchmarks/bench: the page cannot drift from the measured files."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_table",
                                                  ROOT / "benchmarks" / "readme_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = (ROOT / "docs" / "results" / "cpu.md").read_text()
    for line in module.table(ROOT / "benchmarks" / "bench").splitlines():
        if line.startswith(("|", "**Crossover**")):
            assert line in page, line[:100]
