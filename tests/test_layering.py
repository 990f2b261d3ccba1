"""The layers of the "Layout" table of docs/architecture.md, checked.

Every package may import only the packages its row allows (``ALLOWED``): the shared contract
(``polar_core``) nothing of ours; the proxy, the analysis, the trainer and the test tools only the
contract; the trial environment (``polar_trial``) only the contract; the runtime (with the ``polar``
CLI) anything, the trial environment through its top-level package only (``TRIAL_INTERFACE``). Checked twice:

* in the source, every ``import`` statement of every module, the ones inside functions too (a lazy
  import is a dependency all the same); ``if TYPE_CHECKING:`` blocks are left out, they never run;
* in a fresh interpreter per package, which imports all of that package's modules and must not end
  up with a forbidden package loaded (what a reader of the code could miss: an import done by a
  dependency's ``__init__``, ``importlib``).

And no import cycles among our modules (lazy imports included). Files other programs load by path,
in an interpreter without our packages, import nothing of ours (``STANDALONE``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: import name -> the packages of ours it may import (its own aside).
ALLOWED: dict[str, set[str]] = {
    "polar_core": set(),
    "polar_proxy": {"polar_core"},
    "polar_analysis": {"polar_core"},
    "polar_training": {"polar_core"},
    "polar_testing": {"polar_core", "polar_proxy"},  # a capturing proxy for test modules (proxies.py)
    "polar_trial": {"polar_core"},
    "polar_runtime": {"polar_core", "polar_proxy", "polar_analysis", "polar_training", "polar_trial"},
}
#: The runtime uses the trial environment through one small interface, ``polar_trial/__init__.py``'s
#: names; these modules of the runtime may import a module of it, each for its reason.
TRIAL_INTERFACE_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("polar_runtime.cli", "polar_trial.commands"):
        "the CLI wires every area's commands from the area's own commands.py (polar docker is the trial's)",
}
#: Loaded by path by another program (vLLM, in its own venv; a sandbox's Python, in the task's image):
#: may import nothing of ours.
STANDALONE = {"polar_runtime.lenient_tool_parser", "polar_trial.sandbox._init", "polar_trial.sandbox._trialinit",
              "polar_trial.sandbox._homeinit"}
#: Not imported in the fresh interpreters: running them is their purpose (or they need vLLM).
NOT_IMPORTED = STANDALONE | {"polar_training.__main__"}


def package_dirs() -> dict[str, Path]:
    """import name -> folder, as pyproject.toml installs them."""
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name: REPO / folder for name, folder in conf.items()}


def modules() -> dict[str, Path]:
    """Every module of ours: dotted name -> file."""
    out = {}
    for pkg, folder in package_dirs().items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(module of ours it imports, line) for every import statement of a module."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        for t in targets:
            if t.split(".")[0] in ALLOWED:
                out.append((t, node.lineno))
    return out


def graph() -> dict[str, dict[str, int]]:
    mods = modules()
    known = set(mods)
    return {name: {t: line for t, line in imports_of(name, path, known)} for name, path in mods.items()}


def test_every_package_has_a_rule_and_a_row_in_the_layout_table():
    doc = (REPO / "docs" / "architecture.md").read_text()
    layout = doc.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    for pkg, folder in package_dirs().items():
        assert pkg in ALLOWED, f"{pkg}: add its row to ALLOWED (and to the Layout table of docs/architecture.md)"
        assert f"| `{folder.name}/` | `{pkg}` |" in layout, \
            f"docs/architecture.md's Layout table lacks the row of {folder.name}/ ({pkg})"


def test_no_forbidden_import_in_the_source():
    bad = []
    mods = modules()
    for name, targets in graph().items():
        own = name.split(".")[0]
        for target, line in targets.items():
            top = target.split(".")[0]
            if name in STANDALONE or (top != own and top not in ALLOWED[own]):
                bad.append(f"{mods[name].relative_to(REPO)}:{line}: {name} imports {target}")
    assert not bad, "imports the layers forbid (docs/architecture.md, Layout):\n" + "\n".join(bad)


def test_the_runtime_uses_the_trial_environment_through_its_top_level_package_only():
    bad = []
    mods = modules()
    for name, targets in graph().items():
        if name.split(".")[0] != "polar_runtime":
            continue
        for target, line in targets.items():
            if target.startswith("polar_trial.") and (name, target) not in TRIAL_INTERFACE_EXCEPTIONS:
                bad.append(f"{mods[name].relative_to(REPO)}:{line}: {name} imports {target}")
    assert not bad, ("the runtime imports polar_trial's modules, not its interface (export the name from "
                     "polar_trial/__init__.py, or name the exception in TRIAL_INTERFACE_EXCEPTIONS):\n" + "\n".join(bad))


def test_no_import_cycles():
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, {}):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in g.get(v, {}):
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles among our modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


_PROBE = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


@pytest.mark.parametrize("pkg", [p for p in ALLOWED if p != "polar_runtime"])
def test_a_fresh_interpreter_loads_only_what_the_package_may_import(pkg):
    names = [m for m in modules() if m.split(".")[0] == pkg and m not in NOT_IMPORTED]
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(names)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(json.loads(proc.stdout.splitlines()[-1])) & set(ALLOWED)
    assert loaded <= ALLOWED[pkg] | {pkg}, f"importing {pkg} loaded {sorted(loaded - ALLOWED[pkg] - {pkg})}"
