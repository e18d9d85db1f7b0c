"""Plant listed bugs one at a time in a scratch copy of the repository and run the tests meant
to catch each: a test suite that lets a planted bug through asserts less than it promises.

    python scripts/mutate.py                      # every entry of scripts/mutations.json
    python scripts/mutate.py --only hybrid-step-in-place convert-hook-passes-output
    python scripts/mutate.py --json report.json --timeout 300

Each entry of the list (a JSON array) is an object::

    {"id": "a-short-name", "file": "src/effattn/...py", "pattern": "exact text",
     "replacement": "the bug", "tests": ["tests/test_x.py::test_y", ...],
     "description": "one line: what the bug is"}

``pattern`` must occur exactly once in ``file`` (exit 2, one line naming the entry, otherwise:
the code moved and the entry needs updating). The repository (less .git and caches) is copied
to a temporary folder once; for each entry the file is mutated there, ``python -m pytest -x -q``
runs the entry's tests with ``src`` first on the path, and the file is restored. pytest's exit
status 1 (a test failed) is *caught*, 0 is *survived*, anything else (a timeout, a collection or
usage error such as a test id that does not exist) is an *error*. The report is a table on
stdout and, with ``--json``, a JSON file. Exit status: 0 when every entry was caught, 1 when any
survived or errored, 2 for a bad list. Not part of the package and not run in CI: run it before
calling a feature done (docs/testing.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LIST = Path(__file__).resolve().with_name("mutations.json")
FIELDS = ("id", "file", "pattern", "replacement", "tests", "description")
IGNORED = (".git", "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache", "*.egg-info",
           "runs", "results", "effattn-bench", "effattn-approx")


class ListError(Exception):
    """The mutation list cannot be used as it is (its message is one line)."""


@dataclass(frozen=True)
class Mutation:
    id: str
    file: str
    pattern: str
    replacement: str
    tests: tuple[str, ...]
    description: str


@dataclass
class Result:
    id: str
    file: str
    description: str
    status: str  # caught | survived | error
    seconds: float
    detail: str = ""


def load(path: Path) -> list[Mutation]:
    """The entries of the JSON list at ``path``, each with every field, ids unique."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ListError(f"{path}: cannot read the list: {err}") from None
    if not isinstance(raw, list) or not raw:
        raise ListError(f"{path}: expected a non-empty JSON array of entries")
    entries, seen = [], set()
    for i, item in enumerate(raw):
        missing = [f for f in FIELDS if not isinstance(item, dict) or f not in item]
        if missing:
            raise ListError(f"{path}: entry {i} lacks {', '.join(missing)}")
        tests = item["tests"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise ListError(f"{path}: entry {item['id']}: tests must be a non-empty list of "
                            "pytest ids")
        if item["id"] in seen:
            raise ListError(f"{path}: entry id {item['id']} appears twice")
        if item["pattern"] == item["replacement"]:
            raise ListError(f"{path}: entry {item['id']}: the replacement equals the pattern")
        seen.add(item["id"])
        entries.append(Mutation(item["id"], item["file"], item["pattern"], item["replacement"],
                                tuple(tests), item["description"]))
    return entries


def check(root: Path, entries: list[Mutation]) -> None:
    """``ListError`` unless every entry's pattern occurs exactly once in its file."""
    for m in entries:
        path = root / m.file
        if not path.is_file():
            raise ListError(f"entry {m.id}: no file {m.file}")
        count = path.read_text().count(m.pattern)
        if count != 1:
            raise ListError(f"entry {m.id}: pattern found {count} times in {m.file} (expected "
                            f"exactly once): {m.pattern!r}")


def run_one(scratch: Path, m: Mutation, timeout: float) -> Result:
    """Plant ``m`` in ``scratch``, run its tests, restore the file."""
    path = scratch / m.file
    original = path.read_text()
    path.write_text(original.replace(m.pattern, m.replacement, 1))
    env = {**os.environ, "PYTHONPATH": str(scratch / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
            cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
        status = {0: "survived", 1: "caught"}.get(proc.returncode, "error")
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        # The first test that caught it, or pytest's last words.
        detail = failed[0] if failed else (lines or proc.stderr.splitlines() or [""])[-1]
        if status == "error":
            detail = f"pytest exit {proc.returncode}: {detail}"
    except subprocess.TimeoutExpired:
        status, detail = "error", f"timed out after {timeout:g} s"
    finally:
        path.write_text(original)
    return Result(m.id, m.file, m.description, status, time.monotonic() - start, detail)


def table(results: list[Result]) -> str:
    """The results as a Markdown table with a totals line."""
    lines = ["| entry | file | status | s | what was planted |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.id} | {r.file} | {r.status} | {r.seconds:.0f} | {r.description} |")
    lines.append("")
    lines.append(summary(results))
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in ("caught", "survived", "error")}
    return (f"{len(results)} entries: {counts['caught']} caught, {counts['survived']} survived, "
            f"{counts['error']} errors")


def report(results: list[Result]) -> dict:
    """The JSON report: every entry's result and the counts."""
    return {"entries": [asdict(r) for r in results],
            "caught": sum(r.status == "caught" for r in results),
            "survived": sum(r.status == "survived" for r in results),
            "errors": sum(r.status == "error" for r in results)}


def copy_repo(root: Path, into: Path) -> Path:
    scratch = into / "repo"
    shutil.copytree(root, scratch, ignore=shutil.ignore_patterns(*IGNORED))
    return scratch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", type=Path, default=DEFAULT_LIST,
                        help="the mutation list (default scripts/mutations.json)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository to copy")
    parser.add_argument("--only", nargs="+", metavar="ID", help="run these entries alone")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds for each entry's tests (default 600)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the report here")
    parser.add_argument("--check", action="store_true",
                        help="only check that every pattern is found exactly once")
    args = parser.parse_args(argv)
    try:
        entries = load(args.list)
        if args.only:
            unknown = sorted(set(args.only) - {m.id for m in entries})
            if unknown:
                raise ListError(f"--only: no entry {', '.join(unknown)} in {args.list}")
            entries = [m for m in entries if m.id in args.only]
        check(args.root, entries)
    except ListError as err:
        print(f"mutate.py: {err}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{len(entries)} entries: every pattern found exactly once")
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="effattn-mutate-") as tmp:
        scratch = copy_repo(args.root, Path(tmp))
        for m in entries:
            result = run_one(scratch, m, args.timeout)
            print(f"{result.status:8} {result.seconds:5.0f} s  {m.id}: {result.detail}",
                  file=sys.stderr, flush=True)
            results.append(result)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(report(results), indent=2) + "\n")
    return 0 if all(r.status == "caught" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
