"""The house rules of the package layout, checked on the source.

- `taco_jax` (with `pallas_kernels`) is a library: importing it loads no Flax, Optax, Orbax,
  models (taco_models) or training application, and its declared dependencies are JAX and
  NumPy only.
- The import graph of the first-party modules has no cycle, counting imports inside functions
  too, and runs one way: taco_train -> taco_models -> taco_jax -> pallas_kernels -> the codec
  definitions (taco_jax.codecs, taco_jax.tahquant).

An edge is an import written in a file. Importing `taco_jax.codecs` also runs
`taco_jax/__init__.py` (Python initializes a package before its submodules), which is not an
edge here: the codec module needs nothing of the package, and the dispatcher imports the kernels
lazily, so importing either package first works (checked in a fresh interpreter below).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
PACKAGES = ("taco_jax", "pallas_kernels", "taco_models", "taco_train")
# The directory of each package (pyproject.toml's package-dir: models/ installs as taco_models).
DIRECTORIES = {
    "taco_jax": "taco_jax",
    "pallas_kernels": "pallas_kernels",
    "taco_models": "models",
    "taco_train": "taco_train",
}
APP_MODULES = (
    "flax",
    "optax",
    "orbax",
    "taco_models",
    "taco_train",
    "tokenizers",
    "matplotlib",
    "tqdm",
    "safetensors",
)
# Which first-party packages each package may import. pallas_kernels may import only the codec
# definitions of taco_jax and its platform description (checked separately below).
PLUGIN_INTERFACE = {"taco_jax.codecs", "taco_jax.tahquant", "taco_jax.target"}
ALLOWED = {
    "taco_jax": {"taco_jax", "pallas_kernels"},
    "pallas_kernels": {"pallas_kernels", "taco_jax"},
    "taco_models": {"taco_models", "taco_jax"},
    "taco_train": {"taco_train", "taco_models", "taco_jax"},
}


def _module_name(package: str, path: Path) -> str:
    parts = (package, *path.relative_to(REPO / DIRECTORIES[package]).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(package, path): path
        for package in PACKAGES
        for path in (REPO / DIRECTORIES[package]).rglob("*.py")
    }


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """First-party modules `path` imports anywhere (module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import sub` imports the submodule pkg.sub where one exists.
            names = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in modules
                else node.module
                for alias in node.names
            ]
        else:
            continue
        found.update(name for name in names if name.split(".")[0] in PACKAGES)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) for name, path in modules.items()}


def test_graph_walk_sees_the_known_edges():
    """The walk itself: it finds a function-level import and a `from pkg import module`."""
    graph = _graph()
    assert "pallas_kernels" in graph["taco_jax._backends"]  # imported inside a function
    assert "taco_jax.codecs" in graph["pallas_kernels.encode_kernel"]
    assert "taco_jax.tahquant" in graph["pallas_kernels.tahquant_kernel"]
    # the codec definitions need nothing of the package but each other
    assert graph["taco_jax.tahquant"] <= {"taco_jax.codecs"}


def test_no_import_cycle():
    graph = _graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :] + [module]
            pytest.fail(f"import cycle: {' -> '.join(cycle)}")
        if module in done or module not in graph:
            return
        for target in sorted(graph[module]):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_imports_run_one_way():
    for module, targets in _graph().items():
        package = module.split(".")[0]
        for target in targets:
            assert target.split(".")[0] in ALLOWED[package], f"{module} imports {target}"
            if package == "pallas_kernels" and target.startswith("taco_jax"):
                assert target in PLUGIN_INTERFACE, f"{module} imports {target}"


def test_importing_the_library_loads_no_app_dependency():
    code = (
        "import sys, taco_jax, taco_jax.telemetry, pallas_kernels\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {APP_MODULES!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_kernels_import_first_and_dispatch():
    """`import pallas_kernels` before `taco_jax`: no partially initialized module on the way."""
    code = (
        "import pallas_kernels, jax\n"
        "from taco_jax import _backends, codecs, target\n"
        "x = jax.numpy.ones((1, 128))\n"
        "ops = _backends.get_ops('pallas_interpret', target.probe())\n"
        "print(ops.encode(codecs.get_codec('taco'), x).shape)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "(1, 136)", out.stdout + out.stderr


def test_declared_dependencies():
    """The core needs JAX and NumPy; the training stack is an extra; versions are ranges."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def names(requirements):
        return {r.split(">")[0].split("<")[0].split("=")[0].strip() for r in requirements}

    assert names(project["dependencies"]) == {"jax", "numpy"}
    assert {"flax", "optax", "orbax-checkpoint"} <= names(project["optional-dependencies"]["train"])
    assert not any("==" in r for r in project["dependencies"])


def _pins(constraints: Path) -> dict[str, str]:
    """{canonical name: version} of a constraints file's `name==version` lines."""
    from packaging.utils import canonicalize_name

    pins = {}
    for line in constraints.read_text().splitlines():
        requirement = line.split("#")[0].strip()
        if requirement:
            name, version = requirement.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


@pytest.mark.parametrize("constraints", ["constraints.txt", "constraints-latest.txt"])
def test_constraints_within_declared_ranges(constraints):
    """Both files CI installs with (the GPU machine's versions, and the newest the ranges allow)
    pin the JAX stack at versions that the declared ranges admit, so that each resolves."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for extra in ("train", "test"):
        declared += project["optional-dependencies"][extra]
    pins = _pins(REPO / constraints)
    assert {"jax", "jaxlib", "numpy", "flax", "optax", "orbax-checkpoint"} <= pins.keys()
    # jax requires the jaxlib of its own version (its metadata: jaxlib<=its version).
    assert pins["jaxlib"] == pins["jax"], pins
    outside = {}
    for requirement in map(Requirement, declared):
        name = canonicalize_name(requirement.name)
        if name in pins and not requirement.specifier.contains(pins[name], prereleases=True):
            outside[name] = (pins[name], str(requirement.specifier))
    assert not outside, f"{constraints}: pinned outside the declared ranges: {outside}"
