"""Event pacing in an engine replica: under load a stream's events carry several tokens; alone, every token."""

from deployments.api.events import TokenEvent
from deployments.replica.pacing import EventPacer


def test_interval_grows_with_open_streams_and_shrinks_as_they_close():
    pacer = EventPacer(events_per_s=64)
    streams = [pacer.stream().__enter__() for _ in range(32)]
    assert pacer.interval_s() == 0.5
    for stream in streams[:24]:
        stream.__exit__(None, None, None)
    assert pacer.interval_s() == 0.125


def test_first_visible_text_goes_at_once_then_the_stream_is_paced():
    pacer = EventPacer(events_per_s=1e-9)  # an interval far longer than the test
    with pacer.stream() as pace:
        assert pace.due()
        pace.sent(TokenEvent([1], [""]))  # a token whose text the detokenizer still holds back
        assert pace.due()
        pace.sent(TokenEvent([2], [" Paris"]))
        assert not pace.due()
    assert pacer.open_streams == 0
