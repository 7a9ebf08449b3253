"""The project's layout and its import rule, read from the source with `ast` (no JAX).

Imports flow one way: the CLI (tinyllm.py) and scripts/ -> stages (`stage.py`, `*_stage.py`)
-> configs/ -> the library (tokenizer/, model/) -> plumbing/. A module imports only from its
own layer or the ones after it, so no library module imports a stage or configs/; a stage
uses no other stage; tokenizer/ imports nothing from model/ or configs/; plumbing/ imports
nothing else of the project; and no chain of imports made at import time comes back to where
it started.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("plumbing", "tokenizer", "model", "configs")
LAYERS = {"plumbing": 0, "library": 1, "configs": 2, "stage": 3, "cli": 4}


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the CLI, the scripts and every package module."""
    files = {"tinyllm": root / "tinyllm.py"} if (root / "tinyllm.py").is_file() else {}
    for path in sorted((root / "scripts").glob("*.py")):
        files[f"scripts.{path.stem}"] = path
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


def layer(name: str) -> str:
    top, last = name.split(".")[0], name.split(".")[-1]
    if top in ("tinyllm", "scripts"):
        return "cli"
    if last == "stage" or last.endswith("_stage"):
        return "stage"
    if top in ("configs", "plumbing"):
        return top
    return "library"


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(project module imported, line, whether at import time) for every import in the file:
    module level, inside functions and under `if TYPE_CHECKING:` alike (only module-level
    imports outside TYPE_CHECKING run at import time). `from package import name` names the
    submodule when there is one, or the module a lazy `_EXPORTS` table loads it from."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    at_import_time = {id(node) for node in run_at_import(tree.body)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            targets = []
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                lazy = lazy_exports(node.module, modules).get(alias.name)
                targets.append(candidate if candidate in modules else lazy or node.module)
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append((target, node.lineno, id(node) in at_import_time))
    return found


def run_at_import(body: list[ast.stmt]):
    """The import statements among `body` that run when the module is imported: at module
    level, inside `try`, `with` and `if` blocks, but not functions, classes or
    `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                yield from run_at_import(node.body)
            yield from run_at_import(node.orelse)
        elif isinstance(node, ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody"):
                yield from run_at_import(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                yield from run_at_import(handler.body)


def lazy_exports(package: str, modules: dict[str, Path]) -> dict[str, str]:
    """A package's `_EXPORTS = {name: module}` table (exports loaded on first use)."""
    path = modules.get(package)
    if path is None or path.name != "__init__.py":
        return {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_EXPORTS":
            return ast.literal_eval(node.value)
    return {}


def import_problems(root: Path) -> list[str]:
    """Every break of the import rule in the tree at `root`, one line each."""
    modules = module_files(root)
    problems = []
    edges: dict[str, list[str]] = {name: [] for name in modules}
    for name, path in modules.items():
        where = path.relative_to(root)
        for target, line, at_import in imports_of(name, path, modules):
            ours, theirs = layer(name), layer(target)
            if at_import and target not in edges[name]:
                edges[name].append(target)
            if LAYERS[theirs] > LAYERS[ours]:
                problems.append(f"{where}:{line}: the {ours} imports the {theirs} {target}")
            elif ours == theirs == "stage":
                problems.append(f"{where}:{line}: a stage imports another stage, {target}")
            elif name.startswith("tokenizer") and target.startswith(("model", "configs")):
                problems.append(f"{where}:{line}: tokenizer/ imports {target}")
            elif ours == "plumbing" and theirs != "plumbing":
                problems.append(f"{where}:{line}: plumbing/ imports {target}")
    problems += [f"import-time cycle: {' -> '.join(cycle)}" for cycle in cycles(edges)]
    return problems


def cycles(edges: dict[str, list[str]]) -> list[list[str]]:
    """One cycle (as a path that ends where it starts) per back edge of a depth-first walk."""
    found, state = [], {}  # state: 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in edges.get(node, ()):
            if state.get(nxt) == 1:
                loop = path[path.index(nxt) :]
                start = loop.index(min(loop))  # told from its first name, whatever the walk
                found.append([*loop[start:], *loop[:start], loop[start]])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_the_project_keeps_the_import_rule():
    assert import_problems(ROOT) == []


def test_the_check_finds_each_kind_of_break(tmp_path):
    """A tree that breaks every rule once: each break is reported, and only those."""
    files = {
        "plumbing/__init__.py": "",
        "plumbing/errors.py": "from tokenizer.base import Tokenizer\n",
        "tokenizer/__init__.py": '_EXPORTS = {"Tokenizer": "tokenizer.base"}\n',
        "tokenizer/base.py": "import plumbing.errors\n",
        "tokenizer/stage.py": "def run():\n    from model.network import gpt\n",
        "model/__init__.py": "",
        "model/network/__init__.py": "",
        "model/network/gpt.py": "from model.network.layers import x\n"
        "from tokenizer import Tokenizer\n",
        "model/network/layers.py": "from model.network.gpt import GPT\n",
        "model/train_stage.py": "from model.inference_stage import run\n",
        "model/inference_stage.py": "from configs.schema import Config\n",
        "model/rundir/__init__.py": "",
        "model/rundir/trained.py": "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from model.inference_stage import run\n",
        "configs/__init__.py": "",
        "configs/schema.py": "from model.network.gpt import GPT\n",
        "scripts/quantize.py": "import model.train_stage\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    problems = import_problems(tmp_path)
    expected = [
        "plumbing/errors.py:1: the plumbing imports the library tokenizer.base",
        "tokenizer/stage.py:2: tokenizer/ imports model.network.gpt",
        "model/train_stage.py:1: a stage imports another stage, model.inference_stage",
        "model/rundir/trained.py:3: the library imports the stage model.inference_stage",
        "import-time cycle: model.network.gpt -> model.network.layers -> model.network.gpt",
        "import-time cycle: plumbing.errors -> tokenizer.base -> plumbing.errors",
    ]
    assert sorted(problems) == sorted(expected), problems


def test_each_job_is_one_hop_away():
    """model/ is grouped by job: at most 8 modules at its root, every library file a
    reader can take in (at most 600 lines)."""
    root_modules = [p.name for p in (ROOT / "model").glob("*.py")]
    assert len(root_modules) <= 8, root_modules
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            assert lines <= 600, f"{path.relative_to(ROOT)} has {lines} lines"


def test_no_generic_import_names_outside_the_checkout(tmp_path):
    """`pip install -e .` installs the dependencies and builds the C cores in place, but maps
    no package: from any other directory, `import tokenizer` (model, configs, plumbing) finds
    nothing of tinyllm, so a user's own `model/` or PyPI's `tokenizer` is never shadowed."""
    code = (
        "import importlib.util, json; print(json.dumps({n: getattr(importlib.util.find_spec(n), "
        f"'origin', None) for n in {[*PACKAGES, 'tinyllm']!r}}}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    ours = {
        name: origin for name, origin in found.items() if origin and ROOT in Path(origin).parents
    }
    assert ours == {}
