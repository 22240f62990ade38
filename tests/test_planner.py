"""`specmesh plan`'s sizing from two metric snapshots (no processes; the command against
a live deployment is in test_services.py)."""

from __future__ import annotations

import pytest
from specmesh.services.planner import Samples, plan

pytestmark = pytest.mark.unit

WINDOW = 10.0


def decode_worker(step_s: float, wait_s: float, queued: float = 0.0) -> tuple[Samples, Samples]:
    before = {"specmesh_verify_seconds_sum": 5.0, "specmesh_verify_seconds_count": 100.0}
    after = {
        "specmesh_verify_seconds_sum": 5.0 + step_s,
        "specmesh_verify_seconds_count": 100.0 + step_s / 0.02,
        "specmesh_draft_wait_seconds_total": wait_s,
        "specmesh_spec_verify_steps_total": 200.0,
        "specmesh_spec_accepted_tokens_total": 160.0,
        "sglang:num_queue_reqs": queued,
    }
    return before, after


def drafter(draft_s: float) -> tuple[Samples, Samples]:
    after = {"specmesh_draft_seconds_sum": draft_s, "specmesh_draft_seconds_count": draft_s / 0.01}
    return {}, after


def test_pools_are_sized_by_their_busy_time() -> None:
    # Two decode workers each busy 9 s of 10 (6 stepping, 3 waiting for drafts): 18 busy
    # seconds need 3 workers at 80%; drafters busy 2 s each need 1.
    p = plan([decode_worker(6, 3), decode_worker(6, 3)], [drafter(2), drafter(2)], WINDOW, 0.8)
    assert (p.decode_needed, p.drafters_needed) == (3, 1)
    assert p.decode.step_seconds == pytest.approx(0.02)
    assert p.acceptance_length == pytest.approx(1 + 320 / 400)
    assert p.nomad_vars() == "-var decode_count=3 -var drafter_count=1"


def test_a_queue_counts_as_busy_and_idle_pools_keep_one() -> None:
    p = plan([decode_worker(1, 0, queued=3)], [], WINDOW, 0.8)
    assert (p.decode_needed, p.drafters_needed) == (2, 0)  # 10 busy s of 8 allowed; no drafters
    idle = plan([decode_worker(0, 0)], [drafter(0)], WINDOW, 0.8)
    assert (idle.decode_needed, idle.drafters_needed) == (1, 1)
    assert idle.acceptance_length == pytest.approx(1.8)
