"""A hand-made corpus of malformed and adversarial news events, as data (no tests here).

Each ``Case`` is a raw payload (the bytes of one JSON Lines line or one Pub/Sub message) and the one
outcome the input contract (docs/input.md: the contract and the dead-letter reasons table) gives it:
- a dead-letter reason (``Reason``): the specific code a person would act on;
- ``ROW``: valid, however nasty (markup, invisible characters, path-like ids...): exactly one row;
- ``DUPLICATE``: valid, but another case with the same id survives the batch dedup rule (the copy
  published last wins), so it is dropped and counted.

The expected outcomes come from the contract, not from running the code. Where the code is known
to disagree, ``note`` says so (reported as a bug; the tests still assert the contract).

Limits below are the ones the tests run with (small, so that the oversized cases stay small).
Dates relative to now are computed at import: the tests use them within seconds.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Optional

from transforms.types import Reason

ROW = "row"
DUPLICATE = "duplicate"

MAX_PAYLOAD_BYTES = 32 * 1024
MAX_TEXT_CHARS = 10_000
MAX_FUTURE_SKEW_S = 86_400
DEAD_LETTER_PAYLOAD_BYTES = 4096

NOW = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    payload: bytes
    expected: str  # a Reason code, ROW or DUPLICATE
    note: str = ""
    duplicate_of: Optional[str] = None  # DUPLICATE: the case whose copy must survive

    @property
    def batch_compatible(self) -> bool:
        """Whether the payload survives as ONE line of a JSON Lines file. A line ends at b"\\n" and
        loses a final b"\\r" (docs/input.md: JSON Lines), so such payloads can only arrive as
        Pub/Sub messages; the batch test leaves them out rather than test something else."""
        return b"\n" not in self.payload and not self.payload.endswith(b"\r")


def ev(**fields) -> bytes:
    """A JSON object with these fields, UTF-8, non-ASCII kept as is."""
    return json.dumps(fields, ensure_ascii=False).encode("utf-8")


def rfc3339(when: dt.datetime, offset_h: int = 0) -> str:
    """``when`` (aware) written in another UTC offset, e.g. +23:00."""
    local = when.astimezone(dt.timezone(dt.timedelta(hours=offset_h)))
    return local.isoformat()


def _padded_to(size: int, **fields) -> bytes:
    """A valid event padded with an unknown field to exactly ``size`` bytes."""
    base = ev(**fields, pad="")
    return ev(**fields, pad="p" * (size - len(base)))


_SKEW = dt.timedelta(seconds=MAX_FUTURE_SKEW_S)

CORPUS: list[Case] = [
    # ---- valid but nasty: each becomes exactly one row ----
    Case("html_script_injection", ev(
        id="row-html", title="Markets <script>alert('t')</script>rally",
        body="<p>Shares <b>rose</b> &amp; bonds fell.</p><img src=x onerror=alert(1)>"
             "<iframe src='javascript:alert(1)'></iframe><style>p{color:red}</style>"), ROW),
    Case("zero_width_and_rtl_in_text", ev(
        id="row-bidi", title="Pay\u200bment \u202eslaes\u202c report",
        body="Funds \u2066isolated\u2069 moved\u200d through \u200fthe\u200e bank\ufeff today."),
         ROW),
    Case("emoji", ev(id="row-emoji", title="Stocks \U0001F4C8\U0001F680 soar",
                     body="Families \U0001F469\u200D\U0001F469\u200D\U0001F467 cheer in "
                          "\U0001F1EC\U0001F1E7 as markets rise."), ROW),
    Case("mojibake", ev(id="row-mojibake", title="CafÃ© owners welcome Â£5m fund",
                        body="itâ€™s a boost for the high street"), ROW),
    Case("cjk_in_english", ev(id="row-cjk", title="Bank of Japan (日本銀行) holds rates",
                              body="The Bank of Japan (日本銀行) kept its rate; the Bank of Korea "
                                   "(한국은행) and China's central bank (中国人民银行) did too."),
         ROW),
    Case("cjk_and_hangul", ev(id="unreadable-cjk", title="日本銀行は金利を据え置いた",
                              body="中文新闻：央行维持利率不变。한국은행도 금리를 동결했다."),
         Reason.UNREADABLE_FOR_MODEL,
         note="12 of its 51 tokens are [UNK] to the English MiniLM (kana, some hanzi): 0.235"),
    Case("very_long_title", ev(id="row-long-title", title="markets rally again " * 100,
                               body="Short body."), ROW,
         note="2,000 characters: at text.max_title_chars, over max_tokens (head kept)"),
    Case("unclosed_tags_flood", ev(id="row-unclosed-tags", title="Unclosed tags",
                                   body="Shares rose today. " * 20 + "<a" * 3000), ROW,
         note="6,000 characters of tags that never close: quadratic in Python 3.11.7's HTML "
              "parser; newsvec's allowance bounds it (the same text comes out)"),
    Case("zalgo_marks", ev(id="row-zalgo", title="Zalgo",
                           body="Z" + "\u0301\u0316" * 3000 + " text of the story"), ROW,
         note="6,000 combining marks of alternating classes on one letter: cut to 30"),
    Case("special_tokens_in_text", ev(id="row-special-tokens", title="Markets [SEP] [CLS]",
                                      body="Markets rose [SEP] [CLS] [MASK] [PAD] today. In "
                                           "BERT, [UNK] stands for an unknown word."), ROW,
         note="read as text: the model's input holds special tokens only around the text, and "
              "a written [UNK] is not an unknown word"),
    Case("lines_of_c1_controls", ev(id="row-c1-lines", title="C1 lines", body="\x80\n" * 2000),
         ROW, note="4,000 lines for ftfy, each fixed on its own (to the euro sign): a line that "
                   "comes again is fixed once"),
    Case("unclosed_comment_then_markup", ev(id="row-unclosed-comment", title="Comment",
                                            body="x<!-- y <b>bold</b> z"), ROW,
         note="a comment that never closes is text as far as the next '>', its '<'s defused: "
              "'x< !-- y < b>bold z'"),
    Case("long_words_between_arabic_commas", ev(id="row-long-words", title="Long words",
                                                body=("\u3042" * 100 + "\u060c") * 90), ROW,
         note="words of 100 kana (WordPiece reads each again per token) between punctuation "
              "outside the Latin blocks: the head is tokenized from a short prefix"),
    Case("title_over_max_title_chars", ev(id="title-over-limit",
                                          title="markets rally again " * 101, body="Short."),
         Reason.TEXT_TOO_LONG, note="2,020 characters: a title is at most text.max_title_chars"),
    Case("id_path_traversal", ev(
        id="../../etc/passwd", title="Traversal", body="An id like a path."), ROW),
    Case("id_slashes_spaces_unicode", ev(id="news/2026 11/ünïcödé Ωμέγα", body="Unicode id."), ROW),
    Case("id_windows_path", ev(id="C:\\Windows\\System32\\drivers\\etc\\hosts", body="Windows."),
         ROW),
    Case("id_shell_metacharacters", ev(id="$(rm -rf /); `id` | tee >x & echo *", body="Shell."),
         ROW),
    Case("id_with_nul", ev(id="evt\u0000nul", body="A NUL inside the id."), Reason.INVALID_ID,
         note="no store can hold NUL in text: dead-lettered at parse, never a load that fails"),
    Case("id_with_escaped_newline", ev(id="line1\nline2", body="Newline in the id, escaped."),
         Reason.INVALID_ID, note="a control character: not in an identifier"),
    Case("id_zero_width_space_only", ev(id="\u200b", body="An invisible id is still an id."), ROW,
         note="U+200B is not White_Space, so the id is a non-empty string"),
    Case("id_256_characters", ev(id="i" * 256, body="Id at the length limit."), ROW),
    Case("id_256_astral_characters", ev(id="\U0001F600" * 256, body="1,024 bytes, 256 characters."),
         ROW, note="the limit counts characters, not bytes or UTF-16 units"),
    Case("id_nfc", ev(id="caf\u00e9-id", body="Composed e-acute."), ROW),
    Case("id_nfd", ev(id="cafe\u0301-id", body="Decomposed e-acute: another id."), ROW,
         note="ids are opaque: not normalized, so not a duplicate of id_nfc"),
    Case("source_url_language_paths", ev(
        id="row-paths", body="Fields that look like paths.", source="/abs/path/../../etc",
        url="file:///etc/passwd", language="en/../../x"), ROW),
    Case("source_windows_and_shell", ev(
        id="row-paths-2", body="More fields that look like paths.", source="..\\..\\windows",
        url="javascript:alert(document.cookie)", language="$(id)"), ROW),
    Case("very_long_source_url_language", ev(
        id="row-long-fields", body="Long optional fields.", source="s/" * 2000,
        url="https://x.example/" + "a" * 5000, language="l" * 3000), ROW),
    Case("published_year_1", ev(
        id="row-year-1", body="Far past.", published_at="0001-01-01T00:00:00Z"), ROW),
    Case("published_year_1_positive_offset", ev(
        id="row-year-1-offset", body="Far past, ahead of UTC.",
        published_at="0001-01-01T00:00:00+01:00"), Reason.INVALID_FIELD,
         note="valid RFC 3339 whose UTC instant (year 0) no reader can hold"),
    Case("published_just_before_epoch", ev(
        id="row-pre-epoch", body="Before 1970.", published_at="1969-12-31T23:59:59.999999Z"), ROW),
    Case("published_nanoseconds", ev(
        id="row-nanos", body="Nine fraction digits.",
        published_at="2026-11-30T09:15:00.123456789Z"), ROW),
    Case("published_offset_plus_14", ev(
        id="row-plus-14", body="Kiribati time.", published_at="2026-11-30T23:15:00+14:00"), ROW),
    Case("published_lowercase_t_z_offset_minus_12", ev(
        id="row-minus-12", body="Baker Island time.", published_at="2026-11-29t21:15:00-12:00"),
         ROW),
    Case("published_within_skew_but_wallclock_beyond", ev(
        id="row-offset-skew", body="20 h ahead in UTC, 43 h ahead on its wall clock.",
        published_at=rfc3339(NOW + dt.timedelta(hours=20), offset_h=23)), ROW,
         note="the skew applies to the UTC instant, not the local wall clock"),
    Case("published_null", ev(id="row-null-date", body="No date.", published_at=None), ROW),
    Case("extra_unknown_fields", ev(
        id="row-extra", body="Unknown fields.", tags=["a", {"b": [1, 2.5, None]}], __proto__={},
        lineage={"message_id": "forged"}, embedding=[0.1] * 8, _id="other"), ROW),
    Case("duplicate_keys_last_wins", b'{"id": "dupkey-first", "title": "First title", '
         b'"id": "dupkey-last", "body": "Duplicate keys.", "title": "Second title"}', ROW,
         note="like json.loads: the last occurrence of a key wins"),
    Case("nesting_in_unknown_field", ev(id="row-nested", body="Nested 50 deep.",
                                        deep=json.loads("[" * 50 + "]" * 50)), ROW),
    Case("huge_float_in_unknown_field", b'{"id": "row-huge-float", "body": "Big exponent.", '
         b'"score": 1e999999}', ROW, note="valid JSON grammar; the field is ignored"),
    Case("carriage_return_as_json_whitespace", b'{"id": "row-cr",\r"body": "CR between members."}',
         ROW),
    Case("surrounding_whitespace", b' \t {"id": "row-ws", "body": "Padded object."} \t ', ROW),
    Case("unicode_line_separators", ev(
        id="row-u2028", body="Line\u2028separator and\u2029paragraph."), ROW),
    Case("escaped_nul_in_body", ev(id="row-nul-body", body="before\u0000after the NUL"), ROW),
    Case("jsonl_injection_in_body", ev(
        id="row-inject", body='"}\n{"id": "injected", "body": "forged row"}\n'), ROW,
         note="no row 'injected' may appear"),
    Case("unicode_escaped_keys_and_values", b'{"\\u0069\\u0064": "row-escaped", '
         b'"\\u0062ody": "\\u0048ello \\ud83d\\ude00"}', ROW),
    Case("html_comment_unterminated", ev(id="row-comment", body="Real words <!-- never closed"),
         ROW),
    Case("body_only_title_null", ev(id="row-body-only", title=None, body="Body alone."), ROW),
    Case("text_at_max_text_chars", ev(id="row-text-limit", title="t" * 100,
                                      body="word " * ((MAX_TEXT_CHARS - 100) // 5)), ROW),
    Case("payload_at_max_payload_bytes", _padded_to(
        MAX_PAYLOAD_BYTES, id="row-payload-limit", body="Exactly at the byte limit."), ROW),
    Case("pretty_printed_multiline", b'{\n  "id": "row-pretty",\n  "body": "Pretty printed."\n}',
         ROW, note="not one JSON Lines line: Pub/Sub only"),
    Case("crlf_terminated", b'{"id": "row-crlf", "body": "CRLF at the end."}\r\n', ROW,
         note="not one JSON Lines line: Pub/Sub only"),

    # ---- duplicates: the copy published last survives ----
    Case("dup_original", ev(id="dup-1", title="Updated story", body="The latest version.",
                            published_at="2026-11-30T12:00:00Z"), ROW),
    Case("dup_older_copy", ev(id="dup-1", title="Original story", body="An older version.",
                              published_at="2026-11-30T08:00:00Z"), DUPLICATE,
         duplicate_of="dup_original"),
    Case("dup_exact_redelivery", ev(id="dup-1", title="Updated story", body="The latest version.",
                                    published_at="2026-11-30T12:00:00Z"), DUPLICATE,
         duplicate_of="dup_original", note="byte-identical to dup_original"),

    # ---- payload_too_large ----
    Case("payload_one_byte_over", _padded_to(
        MAX_PAYLOAD_BYTES + 1, id="big-1", body="One byte over."), Reason.PAYLOAD_TOO_LARGE),
    Case("payload_far_over", _padded_to(
        3 * MAX_PAYLOAD_BYTES, id="big-2", body="Three times over."), Reason.PAYLOAD_TOO_LARGE),
    Case("payload_over_and_not_utf8", b'{"id": "big-3", "body": "' + b"\xff" * MAX_PAYLOAD_BYTES
         + b'"}', Reason.PAYLOAD_TOO_LARGE, note="size is checked before decoding"),

    # ---- invalid_utf8 ----
    Case("utf16_le_with_bom", '{"id": "u16le", "body": "x"}'.encode("utf-16"), Reason.INVALID_UTF8),
    Case("utf16_be_with_bom", b"\xfe\xff" + '{"id": "u16be", "body": "x"}'.encode("utf-16-be"),
         Reason.INVALID_UTF8),
    Case("latin1_byte", b'{"id": "latin1", "body": "caf\xe9"}', Reason.INVALID_UTF8),
    Case("overlong_encoding", b'{"id": "overlong", "body": "\xc0\xaf"}', Reason.INVALID_UTF8),
    Case("utf8_encoded_surrogate", b'{"id": "cesu", "body": "\xed\xa0\x80"}', Reason.INVALID_UTF8),
    Case("truncated_multibyte", b'{"id": "cut-mb", "body": "\xe2\x82', Reason.INVALID_UTF8),

    # ---- invalid_json ----
    Case("truncated_json", b'{"id": "trunc", "body": "cut in the mid', Reason.INVALID_JSON),
    Case("empty_payload", b"", Reason.INVALID_JSON),
    Case("whitespace_only_payload", b" \t ", Reason.INVALID_JSON),
    Case("nul_bytes_only", b"\x00\x00\x00", Reason.INVALID_JSON),
    Case("nul_byte_after_object", b'{"id": "nul-after", "body": "x"}\x00', Reason.INVALID_JSON),
    Case("raw_control_char_in_string", b'{"id": "raw-tab", "body": "a\tb"}', Reason.INVALID_JSON),
    Case("raw_newline_in_string", b'{"id": "raw-nl", "body": "a\nb"}', Reason.INVALID_JSON,
         note="not one JSON Lines line: Pub/Sub only"),
    Case("utf8_bom", b'\xef\xbb\xbf{"id": "bom8", "body": "x"}', Reason.INVALID_JSON,
         note="RFC 8259 lets a parser reject a BOM; it is valid UTF-8, so not invalid_utf8"),
    Case("trailing_comma", b'{"id": "comma", "body": "x",}', Reason.INVALID_JSON),
    Case("single_quotes", b"{'id': 'quotes', 'body': 'x'}", Reason.INVALID_JSON),
    Case("comment_after_object", b'{"id": "comment", "body": "x"} // note', Reason.INVALID_JSON),
    Case("two_objects_on_one_line", b'{"id": "two-a", "body": "x"}{"id": "two-b", "body": "y"}',
         Reason.INVALID_JSON),
    Case("invalid_escape", b'{"id": "escape", "body": "\\x41"}', Reason.INVALID_JSON),
    Case("lone_surrogate_escape", b'{"id": "\\udc00", "body": "x"}', Reason.INVALID_JSON),
    Case("deep_nesting", b'{"id": "deep", "body": "x", "d": ' + b"[" * 5000 + b"]" * 5000 + b"}",
         Reason.INVALID_JSON, note="docs/input.md: nesting too deep is invalid_json"),
    Case("huge_integer_in_unknown_field", b'{"id": "huge-int", "body": "x", "n": ' + b"9" * 5000
         + b"}", Reason.INVALID_JSON, note="over the parser's number limit (RFC 8259 allows one)"),
    Case("nan_in_unknown_field", b'{"id": "nan", "body": "x", "score": NaN}', Reason.INVALID_JSON,
         note="NaN is not JSON (pydantic's parser would take it)"),
    Case("infinity_as_body", b'{"id": "inf", "body": -Infinity}', Reason.INVALID_JSON,
         note="-Infinity is not JSON: invalid_json, not invalid_field"),

    # ---- not_a_json_object ----
    Case("array_top_level", b'[{"id": "in-array", "body": "x"}]', Reason.NOT_AN_OBJECT),
    Case("string_top_level", b'"{\\"id\\": \\"in-string\\"}"', Reason.NOT_AN_OBJECT),
    Case("null_top_level", b"null", Reason.NOT_AN_OBJECT),
    Case("number_top_level", b"42", Reason.NOT_AN_OBJECT),
    Case("boolean_top_level", b"true", Reason.NOT_AN_OBJECT),

    # ---- missing_id ----
    Case("no_id", ev(title="No id", body="x"), Reason.MISSING_ID),
    Case("id_key_in_other_case", ev(ID="upper", body="x"), Reason.MISSING_ID),

    # ---- invalid_id ----
    Case("id_null", ev(id=None, body="x"), Reason.INVALID_ID),
    Case("id_number", ev(id=12345, body="x"), Reason.INVALID_ID),
    Case("id_huge_number", b'{"id": ' + b"9" * 400 + b', "body": "x"}', Reason.INVALID_ID),
    Case("id_boolean", ev(id=True, body="x"), Reason.INVALID_ID),
    Case("id_object", ev(id={"$ne": None}, body="x"), Reason.INVALID_ID),
    Case("id_array", ev(id=["a"], body="x"), Reason.INVALID_ID),
    Case("id_empty", ev(id="", body="x"), Reason.INVALID_ID),
    Case("id_whitespace", ev(id=" \t ", body="x"), Reason.INVALID_ID),
    Case("id_ideographic_space", ev(id="\u3000", body="x"), Reason.INVALID_ID),
    Case("id_257_characters", ev(id="i" * 257, body="x"), Reason.INVALID_ID),
    Case("id_257_astral_characters", ev(id="\U0001F600" * 257, body="x"), Reason.INVALID_ID),

    # ---- invalid_field ----
    Case("title_number", ev(id="f-title", title=42, body="x"), Reason.INVALID_FIELD),
    Case("body_array", ev(id="f-body", body=["x"]), Reason.INVALID_FIELD),
    Case("source_number", ev(id="f-source", body="x", source=7), Reason.INVALID_FIELD),
    Case("url_object", ev(id="f-url", body="x", url={"href": "x"}), Reason.INVALID_FIELD),
    Case("language_boolean", ev(id="f-lang", body="x", language=False), Reason.INVALID_FIELD),
    Case("published_at_epoch_number", ev(id="f-epoch", body="x", published_at=1764000000),
         Reason.INVALID_FIELD),
    Case("published_at_space_separator", ev(id="f-space", body="x",
                                            published_at="2026-11-30 09:15:00Z"),
         Reason.INVALID_FIELD),
    Case("published_at_no_offset", ev(id="f-naive", body="x", published_at="2026-11-30T09:15:00"),
         Reason.INVALID_FIELD),
    Case("published_at_offset_without_colon", ev(id="f-colon", body="x",
                                                 published_at="2026-11-30T09:15:00+0100"),
         Reason.INVALID_FIELD),
    Case("published_at_empty", ev(id="f-empty-date", body="x", published_at=""),
         Reason.INVALID_FIELD),
    Case("published_at_february_30", ev(
        id="f-feb30", body="x", published_at="2026-02-30T09:15:00Z"), Reason.INVALID_FIELD),
    Case("published_at_hour_24", ev(id="f-h24", body="x", published_at="2026-11-30T24:00:00Z"),
         Reason.INVALID_FIELD),
    Case("published_at_offset_24h", ev(id="f-off24", body="x",
                                       published_at="2026-11-30T09:15:00+24:00"),
         Reason.INVALID_FIELD),
    Case("published_at_arabic_indic_digits", ev(
        id="f-digits", body="x", published_at="\u0662\u0660\u0662\u0666-11-30T09:15:00Z"),
         Reason.INVALID_FIELD),
    Case("published_at_week_date", ev(id="f-week", body="x", published_at="2026-W48-1"),
         Reason.INVALID_FIELD),
    Case("published_at_trailing_newline", ev(id="f-nl-date", body="x",
                                             published_at="2026-11-30T09:15:00Z\n"),
         Reason.INVALID_FIELD),
    Case("published_at_object", ev(id="f-date-obj", body="x", published_at={"$date": 1}),
         Reason.INVALID_FIELD),

    # ---- no_text ----
    Case("no_title_no_body", ev(id="nt-none"), Reason.NO_TEXT),
    Case("null_title_null_body", ev(id="nt-null", title=None, body=None), Reason.NO_TEXT),
    Case("empty_title_and_body", ev(id="nt-empty", title="", body=""), Reason.NO_TEXT),
    Case("whitespace_only_text", ev(id="nt-ws", title=" \t\n ", body="\r\n"), Reason.NO_TEXT),
    Case("unicode_spaces_only_text", ev(id="nt-uspace", title="\u3000\u00a0", body="\u2003\u2028"),
         Reason.NO_TEXT),

    # ---- published_at_in_future ----
    Case("published_year_2999", ev(id="fut-2999", body="x", published_at="2999-01-01T00:00:00Z"),
         Reason.PUBLISHED_IN_FUTURE),
    Case("published_9999_behind_utc", ev(id="fut-9999", body="x",
                                         published_at="9999-12-31T23:59:59-23:59"),
         Reason.INVALID_FIELD, note="its UTC instant is in year 10000, which no reader can hold"),
    Case("published_just_beyond_skew", ev(
        id="fut-skew", body="x", published_at=rfc3339(NOW + _SKEW + dt.timedelta(hours=2))),
         Reason.PUBLISHED_IN_FUTURE),
    Case("published_wallclock_near_but_utc_beyond", ev(
        id="fut-offset", body="x",
        published_at=rfc3339(NOW + _SKEW + dt.timedelta(hours=1), offset_h=-23)),
         Reason.PUBLISHED_IN_FUTURE, note="2 h ahead on its wall clock, 25 h ahead in UTC"),

    # ---- updated_at_in_future, and updated_at's own checks ----
    Case("updated_year_2999", ev(id="upd-2999", body="x", updated_at="2999-01-01T00:00:00Z"),
         Reason.UPDATED_IN_FUTURE, note="it would keep its version current for ever"),
    Case("updated_year_0", ev(id="upd-0", body="x", updated_at="0001-01-01T00:00:00+00:01"),
         Reason.INVALID_FIELD),
    Case("updated_not_rfc3339", ev(id="upd-fmt", body="x", updated_at="yesterday"),
         Reason.INVALID_FIELD),

    # ---- text_too_long ----
    Case("text_one_char_over", ev(id="long-1", title="t" * 101,
                                  body="word " * ((MAX_TEXT_CHARS - 100) // 5)),
         Reason.TEXT_TOO_LONG),
    Case("markup_padding_over", ev(id="long-2", body="<p>" * (MAX_TEXT_CHARS // 3 + 1) + "x"),
         Reason.TEXT_TOO_LONG, note="the limit counts the text as sent, markup included"),

    # ---- empty_after_normalization ----
    Case("html_only", ev(id="empty-html", title="<br>", body="<p> </p><div>\n</div>"),
         Reason.EMPTY_AFTER_NORMALIZATION),
    Case("script_and_style_only", ev(id="empty-script",
                                     body="<script>alert(1)</script><style>p{}</style>"),
         Reason.EMPTY_AFTER_NORMALIZATION),
    Case("unterminated_script", ev(id="empty-unterminated", body="<script>steal(document.cookie)"),
         Reason.EMPTY_AFTER_NORMALIZATION),
    Case("image_with_handler_only", ev(id="empty-img", body="<img src=x onerror=alert(1)>"),
         Reason.EMPTY_AFTER_NORMALIZATION),
    Case("entities_only", ev(id="empty-entities", body="&nbsp;&#8203;&#x20;"),
         Reason.EMPTY_AFTER_NORMALIZATION),
    Case("control_characters_only", ev(id="empty-ctrl", body="\u0000\u0001\u0007\u001b"),
         Reason.EMPTY_AFTER_NORMALIZATION),
    Case("zero_width_only", ev(id="empty-zw", title="\u200b", body="\ufeff\u200b"),
         Reason.EMPTY_AFTER_NORMALIZATION),
    Case("invisible_format_characters_only", ev(
        id="empty-format", title="\u200e\u200f", body="\u202e\u2066\u2069\u200c\u200d\u2060\u00ad"),
         Reason.EMPTY_AFTER_NORMALIZATION,
         note="bidi controls, joiners and soft hyphens are dropped; kept, they made a row of "
              "[CLS][SEP] only"),

    # ---- prepare_failed ----
    Case("hostile_marked_section", ev(id="fail-markup", body="<p>x</p><![foo]> text"),
         Reason.PREPARE_FAILED, note="html.parser raises on it (docs/input.md: hostile markup)"),
]

# Plain good events to go with the corpus in the batch run.
GOOD_EVENTS: list[Case] = [
    Case(f"good_{i}", ev(id=f"good-{i}", title=title, body=body, url=f"https://news.example.com/{i}",
                         source="wire", language="en", published_at="2026-11-30T09:15:00Z"), ROW)
    for i, (title, body) in enumerate([
        ("Rates held", "The central bank held interest rates steady on Thursday."),
        ("Rail strike ends", "Train drivers accepted a new pay offer after six weeks."),
        ("Cup final tonight", "Both teams name unchanged sides for the final at Wembley."),
        ("New phone launched", "The handset has a larger battery and a brighter screen."),
        ("Storm warning", "Forecasters warn of gales along the west coast this weekend."),
    ])
]

ALL_CASES: list[Case] = CORPUS + GOOD_EVENTS
BY_NAME: dict[str, Case] = {c.name: c for c in ALL_CASES}


def event_id(case: Case) -> str:
    """The id a valid case's row carries, read with the standard library's json (last key wins)."""
    return json.loads(case.payload.decode("utf-8"))["id"]
