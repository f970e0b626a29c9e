"""The package's layering (docs/design.md, "The shape"), checked on the source: which layer may import
which, the torch-free modules, and no import cycle among module-level imports; inside the device
layer, parity mode (``batch_invariant``) between the model's kernels and the modules that run its
plan; the start-up checks' typed view of the engine.

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
    "cbgen.topology",
}
FRONT = (
    "cbgen.llm",
    "cbgen.async_engine",
    "cbgen.server",
    "cbgen.cli",
    "cbgen.demo",
    "cbgen.integrations",
    "cbgen.distributed",
)
ENGINE = ("cbgen.engine", "cbgen.step", "cbgen.engine_control", "cbgen.lockstep")
# Parity mode sits inside the device layer, between two parts of model/: it uses the kernels,
# attention and per-thread views below it, and the modules that choose and run the parity plan
# (and the start-up check of its direct forward) use it.  Only those may import it.
PARITY = "cbgen.batch_invariant"
PARITY_USERS = ("cbgen.model.plan", "cbgen.model.runner", "cbgen.model.backends", "cbgen.model.support")
BELOW_PARITY = (
    "cbgen.model.kernels",
    "cbgen.model.attention",
    "cbgen.model.thread_view",
    "cbgen.model.cpu_threads",
)
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
    # (Which tensor-parallel shard this process holds is the leaf module cbgen.topology.)
    device = ("cbgen.model", "cbgen.sample", "cbgen.batch_invariant")
    assert _violations(device, (*ENGINE, *FRONT)) == []


def test_the_kernels_do_not_import_parity_mode():
    # The parity kernels' bindings live in batch_invariant/kernels and import model.kernels.
    assert _violations(BELOW_PARITY, (PARITY,)) == []


def test_only_the_parity_plans_users_in_model_import_parity_mode():
    users = {
        m for m, imps in IMPORTS.items() if _under(m, ("cbgen.model",)) for i in imps if _under(i, (PARITY,))
    }
    assert users <= set(PARITY_USERS)
    # ... and parity mode imports none of them: the plan, the runner and the checks sit above it.
    assert _violations((PARITY,), PARITY_USERS) == []


def test_no_package_cycle_between_parity_mode_and_model():
    """With the modules that choose and run the parity plan set aside, batch_invariant and the rest
    of model/ import each other at most one way (all imports, function-level ones included)."""

    def package(name: str) -> str | None:
        if _under(name, (PARITY,)):
            return PARITY
        if _under(name, ("cbgen.model",)) and not _under(name, PARITY_USERS):
            return "cbgen.model"
        return None

    crossing = [
        (m, i)
        for m, imps in IMPORTS.items()
        for i in imps
        if package(m) and package(i) and package(m) != package(i)
    ]
    directions = {(package(m), package(i)) for m, i in crossing}
    assert len(directions) <= 1, sorted(f"{m} imports {i}" for m, i in crossing)


def test_the_start_up_checks_take_a_typed_view_of_the_engine():
    # model/startup.py's StartupTarget, built by the engine: the checks need nothing of cbgen.engine.
    checks = {
        node.name: node for node in TREES["cbgen.model.support"].body if isinstance(node, ast.FunctionDef)
    }
    for name in ("probe", "paged_probe_logits", "check_direct_forward"):
        first = checks[name].args.args[0]
        assert first.annotation is not None and ast.unparse(first.annotation) == "StartupTarget", name


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
        # A kernel that imports parity mode closes a package cycle with batch_invariant/kernels.
        IMPORTS["cbgen.model.kernels.cpu.ops"] = [
            *IMPORTS["cbgen.model.kernels.cpu.ops"],
            "cbgen.batch_invariant.native",
        ]
        for check in (
            test_the_kernels_do_not_import_parity_mode,
            test_only_the_parity_plans_users_in_model_import_parity_mode,
            test_no_package_cycle_between_parity_mode_and_model,
        ):
            with pytest.raises(AssertionError):
                check()
    finally:
        TREES.clear()
        TREES.update(saved[0])
        IMPORTS.clear()
        IMPORTS.update(saved[1])
