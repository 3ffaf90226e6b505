"""Event pacing in an engine replica: under load a stream's events carry several tokens; alone, every token; and no
producing stream waits longer than stream_interval_ms."""

import pytest

from deployments.api.events import TokenEvent
from deployments.replica.pacing import EventPacer


def test_interval_grows_with_open_streams_and_shrinks_as_they_close():
    pacer = EventPacer(events_per_s=64, max_interval_s=10.0)
    streams = [pacer.stream().__enter__() for _ in range(32)]
    assert pacer.interval_s() == 0.5
    for stream in streams[:24]:
        stream.__exit__(None, None, None)
    assert pacer.interval_s() == 0.125


def test_first_visible_text_goes_at_once_then_the_stream_is_paced():
    pacer = EventPacer(events_per_s=1e-9, max_interval_s=60.0)  # an interval far longer than the test
    with pacer.stream() as pace:
        assert pace.due()
        pace.sent(TokenEvent([1], [""]))  # a token whose text the detokenizer still holds back
        assert pace.due()
        pace.sent(TokenEvent([2], [" Paris"]))
        assert not pace.due()
    assert pacer.open_streams == 0


def test_no_producing_stream_waits_longer_than_the_cap():
    """stream_interval_ms: however many streams share the budget, each sends at least every max_interval_s."""
    pacer = EventPacer(events_per_s=64, max_interval_s=0.1)
    streams = [pacer.stream().__enter__() for _ in range(4)]
    assert pacer.interval_s() == 4 / 64  # under the cap: the budget's share
    streams += [pacer.stream().__enter__() for _ in range(60)]
    assert pacer.interval_s() == 0.1


def test_a_bad_stream_interval_is_refused_at_build_by_name():
    from deployments.app import build_app

    for bad in (0, -5, 20_000, "soon"):
        with pytest.raises(ValueError, match="stream_interval_ms"):
            build_app({"stream_interval_ms": bad})
