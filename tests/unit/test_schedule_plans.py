"""The hand-built plans of ``support.plans`` are valid blink-plan/1 plans."""

from __future__ import annotations

import pytest
from support.plans import sample_plans

from blink_horovod.planner.plan import Plan, validate_plan


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name,plan", sample_plans(), ids=[n for n, _ in sample_plans()])
def test_sample_plans_are_valid(name: str, plan: Plan) -> None:
    validate_plan(plan)  # structure; edges were checked against the topology when built
    assert abs(sum(t.fraction for t in plan.trees) - 1.0) < 1e-9
