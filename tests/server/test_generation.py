"""Which job renders a plan, and the server's modules importing each other in one direction only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cbgen.server
from cbgen.server.generation import job_class
from cbgen.server.job import GenerationJob
from cbgen.server.tool_job import ToolCallJob
from cbgen.server.tools import ToolPlan
from cbgen.server.translate import GenerationPlan

SERVER = Path(cbgen.server.__file__).parent


def _imports(name: str) -> set[str]:
    """The cbgen.server modules ``name`` imports, at the top or inside functions."""
    tree = ast.parse((SERVER / f"{name}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cbgen.server."):
            found.add(node.module.rsplit(".", 1)[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("cbgen.server.")}
    return found


def test_job_does_not_import_the_tool_job_that_extends_it():
    assert "job" in _imports("tool_job")
    assert "tool_job" not in _imports("job")
    assert {"job", "tool_job"} <= _imports("generation")


def _plan(tools: ToolPlan | None) -> GenerationPlan:
    return GenerationPlan(True, [[1, 2]], [], 1, False, False, False, tools)


@pytest.mark.parametrize(
    ("tools", "expected"),
    [
        (None, GenerationJob),
        (ToolPlan([], "none"), GenerationJob),
        (ToolPlan([], "auto"), ToolCallJob),
        (ToolPlan([], "named", named="f"), ToolCallJob),
    ],
)
def test_the_job_class_follows_the_tool_plan(tools, expected):
    assert job_class(_plan(tools)) is expected
