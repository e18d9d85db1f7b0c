"""The package's shape: every method is one definition, known to the rest only via the registry."""

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import effattn
from effattn.registry import DEFAULT_METHOD

SRC = Path(effattn.__file__).parent


def _owner_files() -> dict[str, Path]:
    """Method name -> the file that registers it."""
    return {name: Path(inspect.getfile(type(effattn.build(name, head_dim=8, heads=1, max_len=8))))
            for name in effattn.methods()}


def _named_methods(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value in names]


def test_no_module_names_a_method_but_its_own():
    owners = _owner_files()
    names = set(owners)
    offences = []
    for path in sorted(SRC.rglob("*.py")):
        for line, name in _named_methods(ast.parse(path.read_text()), names):
            if path == owners[name]:
                continue
            # The contract's default method is named once, in the registry.
            if path.name == "registry.py" and name == DEFAULT_METHOD:
                continue
            offences.append(f"{path.relative_to(SRC)}:{line} names {name!r}")
    assert not offences, "\n".join(offences)


def test_the_scan_sees_a_method_name():
    tree = ast.parse("x = {'performer': 1}\ny = f'{a}' + 'performer'")
    assert [n for _, n in _named_methods(tree, {"performer"})] == ["performer", "performer"]


def test_import_needs_torch_alone():
    # torch itself may import numpy or tqdm; effattn must add nothing but its own modules and
    # the standard library (no matplotlib, transformers, the tools or the command line), and must
    # import with the tools' dependencies unimportable.
    code = ("import sys; import torch; "
            "sys.modules.update(dict.fromkeys(('numpy', 'matplotlib', 'tqdm'))); "
            "before = set(sys.modules); import effattn, effattn.nn; "
            "print('\\n'.join(sorted(set(sys.modules) - before)))")
    added = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONPATH": str(SRC.parent)}).stdout
    foreign = [m for m in added.split() if m.split(".")[0] not in sys.stdlib_module_names
               and not m.startswith("effattn")]
    assert not foreign, foreign
    tools = [m for m in added.split() if m.startswith(("effattn.tools", "effattn.cli"))]
    assert not tools, tools


def test_running_any_method_never_imports_the_naive_references():
    # effattn.naive holds the dense references of the tests and the error study: building and
    # calling every method (forward, step, call inputs) must not load it.
    code = """
import sys, torch, effattn, effattn.nn
for name in effattn.methods():
    spec = effattn.spec(name)
    attn = effattn.build(name, head_dim=8, heads=2, max_len=16, seed=0,
                         **{c.enabled_by: True for c in spec.call_inputs if c.enabled_by})
    q = k = v = torch.randn(1, 2, 16, 8)

    def call(n):
        dims = dict(B=1, H=2, N=n, M=n, D=8, Dv=8)
        return {c.name: torch.full(c.expected_shape(dims), 0.5)
                for c in attn.call_inputs if c.required}

    attn(q, k, v, causal=spec.causal, **call(16))
    if spec.decoding:
        attn.step(q[:, :, :1], k[:, :, :1], v[:, :, :1], **call(1))
print(sorted(m for m in sys.modules if m.startswith("effattn.naive")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(SRC.parent)}).stdout
    assert out.strip() == "[]", out


def test_the_architecture_example_of_a_new_method_runs():
    # docs/architecture.md, "Adding a method": its file registers a method that the layers, the
    # reference tests and the FLOP model pick up. Run in a process of its own, not to register it
    # in this one.
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    example = doc.split("## Adding a method", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    check = """
import torch, effattn
from effattn.nn import MultiheadAttention
from effattn.registry import Problem
assert "mine" in effattn.methods()
attn = effattn.build("mine", head_dim=8, heads=2, keep=5).double()
q, k, v = (torch.randn(1, 2, 9, 8, dtype=torch.float64) for _ in range(3))
torch.testing.assert_close(attn(q, k, v), effattn.spec("mine").reference(attn, q, k, v))
layer = MultiheadAttention(16, 2, method="mine", keep=4)
assert layer(torch.randn(3, 1, 16))[0].shape == (3, 1, 16)
assert effattn.spec("mine").flops({"keep": 64}, Problem(1, 2, 9, 9, 8, 8)) == 2 * 2 * 9 * 9 * 16
"""
    run = subprocess.run([sys.executable, "-c", example + check], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(SRC.parent)})
    assert run.returncode == 0, run.stderr


def _imports(path: Path, text: str | None = None) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every ``import``/``from ... import`` of effattn in ``path`` (or
    in ``text``, read as that file)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("effattn"):
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names
                      if a.name.startswith("effattn")]
    return found


def _mechanism_imports(path: Path, text: str | None = None) -> list[str]:
    """Imports in ``path`` (or ``text``) of a mechanism's module (effattn/mechanisms/<name>.py)
    or of names from one: the package itself, imported to register them all, is no such import."""
    return [f"{path.relative_to(SRC)}:{line} imports {module} {names}"
            for line, module, names in _imports(path, text)
            if module.startswith("effattn.mechanisms.")
            or (module == "effattn.mechanisms" and names)]


def test_no_module_imports_a_mechanism():
    # A mechanism is known to the rest only through the registry (its spec and its module from
    # build), so adding one touches its own file and its tests: nothing imports from a
    # mechanism's file, another mechanism included.
    offences = [o for path in sorted(SRC.rglob("*.py")) for o in _mechanism_imports(path)]
    assert not offences, "\n".join(offences)


def test_the_scan_sees_a_mechanism_import():
    lines = ["from effattn.mechanisms.local import LocalAttention",
             "import effattn.mechanisms.softmax", "from effattn.mechanisms import local",
             "import effattn.mechanisms", "from effattn import registry"]
    found = _mechanism_imports(SRC / "x.py", "\n".join(lines))
    assert len(found) == 3, found


def test_the_distributed_package_names_no_mechanism_or_engine():
    # effattn.distributed runs the strategy a spec declares; the engines provide the strategies,
    # so it imports neither them nor a mechanism.
    offences = [f"{path.relative_to(SRC)}:{line} imports {module}"
                for path in sorted((SRC / "distributed").rglob("*.py"))
                for line, module, _ in _imports(path)
                if module.startswith(("effattn.mechanisms", "effattn.kernelized",
                                      "effattn.sparse"))]
    assert not offences, "\n".join(offences)


def test_the_library_imports_neither_the_tools_nor_the_cli():
    # The layers of docs/architecture.md: library < tools < cli; a command uses the shared
    # cli.common and the tools, never another command's module; nobody imports a private name.
    offences = []
    for path in sorted(SRC.rglob("*.py")):
        part = path.relative_to(SRC).parts[0]
        for line, module, names in _imports(path):
            where = f"{path.relative_to(SRC)}:{line} imports {module}"
            if part not in ("tools", "cli", "__main__.py") and module.startswith(
                    ("effattn.tools", "effattn.cli")):
                offences.append(where)
            if part == "tools" and module.startswith("effattn.cli"):
                offences.append(where)
            if (part == "cli" and module.startswith("effattn.cli.")
                    and module != "effattn.cli.common"):
                offences.append(where)
            offences += [f"{where}.{n}" for n in names if n.startswith("_")]
    assert not offences, "\n".join(offences)


def test_the_tools_extra_is_what_the_cli_checks_for():
    # `effattn CMD` checks effattn.tools.REQUIRES; the extra must install exactly those, and the
    # core nothing but torch.
    tomllib = pytest.importorskip("tomllib")
    from effattn import tools

    project = tomllib.loads((SRC.parents[1] / "pyproject.toml").read_text())["project"]
    assert [d.split(">")[0] for d in project["dependencies"]] == ["torch"]
    assert sorted(project["optional-dependencies"]["tools"]) == sorted(tools.REQUIRES)
    assert "effattn[tools,hf]" in project["optional-dependencies"]["dev"]


def test_the_numeric_engines_import_no_registry():
    # The kernelized core, its feature maps and the sparse engine are plain numerics: the FLOP
    # model and the base classes that bind them to the contract live beside them.
    numeric = [SRC / "kernelized" / f for f in ("core.py", "chunkwise.py", "cpu.py", "gpu.py",
                                                "features.py", "projections.py")]
    numeric += [SRC / "sparse" / "blockwise.py"]
    offences = [f"{path.relative_to(SRC)}:{line} imports {module}"
                for path in numeric for line, module, _ in _imports(path)
                if module.startswith(("effattn.registry", "effattn.mechanisms"))]
    assert not offences, "\n".join(offences)
