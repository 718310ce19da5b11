"""Property-based fuzzing of the parse and text steps: whatever the bytes, each payload becomes an
event or a dead letter with a known reason, and text preparation never raises."""
import datetime as dt
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.common import make_config
from transforms.parse import ParseError, parse_event
from transforms.text.prepare import _PrepareTextFn
from transforms.types import NewsEvent, Reason

KNOWN_REASONS = {v for k, v in vars(Reason).items() if k.isupper()}
LIMITS = dict(max_payload_bytes=64 * 1024, max_future_skew=dt.timedelta(days=1))
FIELDS = ["id", "title", "body", "url", "source", "language", "published_at"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children,
                                                                      max_size=4),
    max_leaves=12)
hostile_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=400) | st.sampled_from([
    "<p>x</p><![foo]> y", "<![ CDATA[ z", "<script>", "&#0;&#xD800;", "\x00" * 10, "Â£â€™Ã©",
    "<" * 50, "&amp;" * 30, "\u202e\u200b\ufeff", "a" * 3000])
events = st.fixed_dictionaries({}, optional={f: json_values | hostile_text for f in FIELDS})
payloads = (st.binary(max_size=600)
            | events.map(lambda d: json.dumps(d).encode())
            | events.map(lambda d: json.dumps(d, ensure_ascii=False)
                         .encode("utf-8", "surrogatepass"))
            | st.builds(lambda d, n: json.dumps(d).encode()[:n], events, st.integers(0, 200)))


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads)
def test_parse_never_raises_anything_but_a_reasoned_parse_error(raw):
    try:
        event = parse_event(raw, **LIMITS)
    except ParseError as exc:
        assert exc.reason in KNOWN_REASONS and exc.detail
        return
    assert isinstance(event, NewsEvent) and event.id.strip() and len(event.id) <= 256
    assert (event.title or "").strip() or (event.body or "").strip()


_prepare = _PrepareTextFn(make_config().model, max_text_chars=2000, dead_letter_payload_bytes=256)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.builds(NewsEvent, id=st.just("x"), title=st.none() | hostile_text,
                 body=st.none() | hostile_text))
def test_text_preparation_gives_text_or_a_dead_letter_never_an_exception(event):
    result = _prepare._compose(event)
    if isinstance(result, tuple):  # (the prepared title, the text)
        title, text = result
        assert text and text == text.strip() and "\x00" not in text
        assert text.split("\n")[0] == title if title else "\n" not in text
    else:
        assert result.value.reason in KNOWN_REASONS and result.value.step == "prepare_text"
