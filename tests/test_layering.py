"""The package's layering (docs/design.md, "The shape"), checked on the source: which layer may import
which, the torch-free modules, and no import cycle among module-level imports.

Every ``import``/``from`` statement counts for the layer rules, function-level ones included (a lazy
import is still a dependency); the cycle check reads module-level imports only, outside
``if TYPE_CHECKING:`` blocks, since a function-level import runs after both modules are loaded.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Layers from the bottom up; a module may import its own layer and the layers below it.
LEAVES = {
    "cbgen.request",
    "cbgen.sampling_params",
    "cbgen.structured_params",
    "cbgen.outputs",
    "cbgen.inputs",
    "cbgen.envs",
    "cbgen.config",
    "cbgen.utils",
    "cbgen.prompts",
    "cbgen.limits",
    "cbgen.detokenizer",
    "cbgen.output_processor",
}
FRONT = ("cbgen.llm", "cbgen.async_engine", "cbgen.server", "cbgen.cli", "cbgen.demo", "cbgen.integrations")
ENGINE = ("cbgen.engine", "cbgen.step", "cbgen.engine_control")
TORCH_FREE = ("cbgen.core", "cbgen.limits", "cbgen.request", "cbgen.sampling_params", "cbgen.inputs")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted((SRC / "cbgen").rglob("*.py"))}


def _imports(tree: ast.AST) -> list[str]:
    """Every module a tree imports, as dotted names (``from a import b`` gives ``a.b`` when that is a
    module of the package, else ``a``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found.append(full if full in MODULES else node.module)
    return found


def _top_level_imports(tree: ast.Module) -> list[str]:
    body = []
    for node in tree.body:
        is_type_checking = (
            isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        )
        if isinstance(node, ast.Import | ast.ImportFrom):
            body.append(node)
        elif isinstance(node, ast.If | ast.Try) and not is_type_checking:
            body += [n for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom)]
    return _imports(ast.Module(body=body, type_ignores=[]))


TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}
IMPORTS = {name: [m for m in _imports(tree) if m.startswith("cbgen")] for name, tree in TREES.items()}


def _under(name: str, prefixes: tuple[str, ...] | set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(layer: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{mod} imports {imp}"
        for mod, imps in IMPORTS.items()
        if _under(mod, layer)
        for imp in imps
        if _under(imp, forbidden)
    ]


def test_core_imports_only_core_and_leaf_modules():
    allowed = ("cbgen.core", "cbgen.request", "cbgen.sampling_params", "cbgen.structured_params")
    bad = [f"{m} imports {i}" for m, imps in IMPORTS.items() if _under(m, ("cbgen.core",)) for i in imps]
    assert [b for b in bad if not _under(b.split(" imports ")[1], allowed)] == []


def test_device_layers_do_not_import_the_engine_or_the_ways_in():
    device = ("cbgen.model", "cbgen.sample", "cbgen.batch_invariant")
    assert _violations(device, (*ENGINE, *FRONT, "cbgen.distributed.lockstep")) == []
    # model/ sees one thing of distributed/: which tensor-parallel shard this process holds.
    uses = {i for m, imps in IMPORTS.items() if _under(m, ("cbgen.model",)) for i in imps}
    assert {i for i in uses if _under(i, ("cbgen.distributed",))} <= {"cbgen.distributed.topology"}


def test_the_engine_does_not_import_the_ways_in():
    assert _violations(ENGINE, FRONT) == []


def test_leaf_modules_import_only_leaf_modules():
    bad = [
        f"{m} imports {i}"
        for m, imps in IMPORTS.items()
        if m in LEAVES
        for i in imps
        if i not in LEAVES and i != "cbgen"
    ]
    assert bad == []


def test_front_ends_reach_the_engine_only_through_its_facade():
    # The scheduler and the block manager are the engine's; front ends use engine.control.
    # (core.fairness's Fairness is a setting they pass in, not engine state.)
    inner = ("cbgen.core.scheduler", "cbgen.core.block_manager", "cbgen.core.update")
    assert _violations(("cbgen.async_engine", "cbgen.server", "cbgen.llm"), inner) == []


def test_the_runtime_package_does_not_import_the_benchmark_harness():
    # cli.py's `cbgen bench` is the one thin, lazy entry point into the separate cbgen-bench package.
    users = [m for m, imps in IMPORTS.items() for i in imps if i.startswith("cbgen_bench")]
    assert set(users) <= {"cbgen.cli"}


@pytest.mark.parametrize("prefix", TORCH_FREE)
def test_torch_free_modules(prefix: str):
    for mod, tree in TREES.items():
        if _under(mod, (prefix,)):
            assert not [i for i in _imports(tree) if i == "torch" or i.startswith("torch.")], mod


def _cycle() -> list[str] | None:
    graph = {
        name: sorted({i for i in _top_level_imports(tree) if i in MODULES and i != name})
        for name, tree in TREES.items()
    }
    # A package's __init__ runs before its submodules: importing a.b imports a first.
    for name in graph:
        parent = name.rpartition(".")[0]
        if parent in MODULES and parent != "cbgen":
            graph[name] = sorted({*graph[name], parent} - {name})
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1 and not node.startswith(nxt + "."):
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for name in graph:
        if name not in state and (found := visit(name)):
            return found
    return None


def test_no_import_cycle_among_module_level_imports():
    assert _cycle() is None


def test_the_checks_can_fail():
    # A cycle and a layer violation planted in the parsed sources are found.
    saved = dict(TREES), dict(IMPORTS)
    try:
        TREES["cbgen.core.stats"] = ast.parse("import cbgen.core.scheduler\nimport torch")
        TREES["cbgen.core.scheduler"] = ast.parse("import cbgen.core.stats")
        IMPORTS["cbgen.core.stats"] = ["cbgen.engine"]
        assert _cycle() is not None
        with pytest.raises(AssertionError):
            test_core_imports_only_core_and_leaf_modules()
        with pytest.raises(AssertionError):
            test_torch_free_modules("cbgen.core")
    finally:
        TREES.clear()
        TREES.update(saved[0])
        IMPORTS.clear()
        IMPORTS.update(saved[1])
