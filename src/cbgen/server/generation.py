"""Runs a generation plan: submits its prompts and answers with the job that renders them.

The one place that chooses between the plain job (:mod:`cbgen.server.job`) and the job that turns
tool-call blocks into ``tool_calls`` (:mod:`cbgen.server.tool_job`, a subclass of it), so neither of
those modules needs to know about the other's dependents.
"""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import Response

from cbgen.server.job import GenerationJob, respond
from cbgen.server.state import ServerState
from cbgen.server.tool_job import ToolCallJob
from cbgen.server.translate import GenerationPlan

__all__ = ["job_class", "run_plan"]


def job_class(plan: GenerationPlan) -> type[GenerationJob]:
    """The job that renders ``plan``'s output: tool calls parsed out of it when the plan asks."""
    return ToolCallJob if plan.tools is not None and plan.tools.parse else GenerationJob


async def run_plan(state: ServerState, plan: GenerationPlan, request: Request, arrival: float) -> Response:
    """Submits the plan's prompts to the engine (as ``request``'s client) and answers with what they
    generate."""
    base_id = ("chatcmpl-" if plan.chat else "cmpl-") + uuid.uuid4().hex
    client = request.client.host if request.client is not None else None
    streams = state.submit(plan.prompts, plan.params, base_id, client)
    job = job_class(plan)(state, plan, streams, arrival)
    return await respond(job, request, plan.stream)
