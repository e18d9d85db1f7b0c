"""The package as a user gets it: built into a wheel and an sdist, installed in a fresh virtual
environment, and run from there (not from this checkout)."""

import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Imports every public module of the installed package (no component starting with "_") and
# prints where effattn came from, so the test can check it is the wheel, not this checkout.
IMPORT_ALL = """
import importlib, pkgutil, effattn
names = [m.name for m in pkgutil.walk_packages(effattn.__path__, "effattn.")
         if not any(part.startswith("_") for part in m.name.split("."))]
for name in names:
    importlib.import_module(name)
print(effattn.__file__, effattn.__version__, len(names))
"""


@pytest.mark.slow
def test_wheel_installs_and_runs_in_a_fresh_environment(tmp_path):
    pytest.importorskip("build", reason="the dev extra installs `build`")
    # Build from a copy, so that the build's egg-info and build/ never land in the checkout.
    src = tmp_path / "src-tree"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp_path / "dist"
    # --no-isolation: build with this environment's setuptools instead of downloading one.
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel",
                    "--outdir", str(dist), str(src)], check=True, capture_output=True, timeout=600)
    wheels = sorted(dist.glob("effattn-*.whl"))
    sdists = sorted(dist.glob("effattn-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in dist.iterdir())

    # A fresh environment that reuses this one's packages (torch, transformers: no downloads)
    # and gets effattn from the wheel alone (--no-deps: its requirements are already there).
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    str(wheels[0])], check=True, capture_output=True, timeout=600)

    # Run outside the checkout, with no PYTHONPATH, so nothing of ./src can be imported.
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([str(py), "-c", IMPORT_ALL], cwd=tmp_path, env=clean, check=True,
                         capture_output=True, text=True, timeout=600)
    where, version, count = run.stdout.split()
    assert Path(where).is_relative_to(env_dir), where
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version == declared.group(1) and int(count) > 50
    assert (Path(where).parent / "py.typed").exists()

    methods = subprocess.run([str(env_dir / "bin" / "effattn"), "methods"], cwd=tmp_path,
                             env=clean, check=True, capture_output=True, text=True, timeout=600)
    assert "performer" in methods.stdout and "hedgehog" in methods.stdout
