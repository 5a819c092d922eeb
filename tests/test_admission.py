"""rollout.admission.Admission: the request and token caps, the retry hint, and release on error."""

from __future__ import annotations

import grpc
import pytest

from parity.errors import RequestError
from rollout.admission import Admission


def test_requests_past_the_cap_are_refused_with_a_retry_hint() -> None:
    admission = Admission(max_requests=2, max_tokens=1000)
    with admission.admit(10), admission.admit(10):
        with pytest.raises(RequestError) as refused:
            admission.precheck()
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.field == "in_flight_requests"
        assert refused.value.trailing_metadata() == (("retry-after-ms", "1000"),)  # no request finished yet
    with admission.admit(10):  # both slots were released
        assert admission.requests == 1
    assert admission.refused_total == 1
    assert 0 < admission.retry_after_s() < 1.0  # now the mean time of the admitted requests


def test_token_budget_and_a_lone_large_request() -> None:
    admission = Admission(max_requests=8, max_tokens=100)
    with admission.admit(60):
        with pytest.raises(RequestError) as refused, admission.admit(50):
            pass
        assert refused.value.field == "in_flight_tokens"
    with admission.admit(500):  # alone: admitted even over the budget, so it is never refused forever
        assert admission.tokens == 500


def test_a_failing_request_releases_its_slot() -> None:
    admission = Admission(max_requests=1, max_tokens=100)
    with pytest.raises(KeyError), admission.admit(10):
        raise KeyError("engine failed")
    assert admission.requests == 0 and admission.tokens == 0


def test_clients_refused_together_are_told_to_come_back_spread_out() -> None:
    import time

    admission = Admission(max_requests=2, max_tokens=1000)
    with admission.admit(10):
        time.sleep(0.2)  # the mean admitted request now takes ~0.2 s
    mean = admission.retry_after_s()
    assert 0.2 <= mean < 1.0  # a loaded box oversleeps; the hints below are relative to this mean
    hints = []
    with admission.admit(10), admission.admit(10):
        for _ in range(5):
            with pytest.raises(RequestError) as refused:
                admission.precheck()
            hints.append(int(dict(refused.value.trailing_metadata())["retry-after-ms"]))
        # the k-th refusal within one mean time waits (1 + (k-1)/2) means: a slot frees every mean / 2
        expected = [round(1000 * mean * (1 + k / 2)) for k in range(5)]
        assert all(abs(h - e) <= 0.1 * e for h, e in zip(hints, expected, strict=True)), (hints, expected)
        time.sleep(mean + 0.05)  # those refusals are older than a mean time: back to one mean
        assert abs(admission.retry_after_s() - mean) < 0.1 * mean
