"""The job runner: a shutdown waits for the running job only as long as the grace period allows."""

from __future__ import annotations

import threading
import time

import pytest

from hps_service.admin.jobs import JobRunner
from hps_service.errors import UnavailableError


def test_close_is_bounded_by_its_timeout_and_refuses_new_jobs() -> None:
    runner = JobRunner()
    release = threading.Event()
    started = threading.Event()
    running = runner.submit("block", {}, lambda job: (started.set(), release.wait(30), {})[-1])
    queued = runner.submit("queued", {}, lambda job: {"ran": True})
    assert started.wait(10)
    t0 = time.monotonic()
    assert runner.close(timeout_s=0.2) is False  # the running job outlives the grace: not waited for
    assert time.monotonic() - t0 < 5
    with pytest.raises(UnavailableError):
        runner.submit("late", {}, lambda job: {})
    release.set()
    deadline = time.monotonic() + 10
    while running.state != "succeeded" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert running.state == "succeeded"
    assert queued.state == "pending"  # dropped by the shutdown, never run


def test_close_waits_for_a_job_that_finishes_in_time() -> None:
    runner = JobRunner()
    job = runner.submit("quick", {}, lambda job: (time.sleep(0.1), {"done": 1})[-1])
    assert runner.close(timeout_s=30) is True
    assert job.state == "succeeded" and job.result == {"done": 1}
