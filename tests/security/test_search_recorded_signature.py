"""``newsvec search`` checks the config against the embedding signature the output's committed
run recorded (``incremental.embedding_signature``, a JSON object as a string: ``signature_of``).
A summary that holds one that is not such a string (corrupt, or written by whoever can write the
output prefix) is an output that cannot be checked: ``OutputUncheckable`` (a ``ConfigError``:
``newsvec search`` says so and exits 2), as for a summary that cannot be read. Today
``check_signature`` ends in a traceback (``JSONDecodeError``, ``AttributeError``,
``TypeError``) for a string that is not a JSON object, and searches unchecked, silently, when the
key holds a value that is not a string (``RunSummary.embedding_signature`` reads it as None, as
for a summary of a release before the signature was recorded, which has no key)."""
from __future__ import annotations

import pytest

from pipeline.search import OutputUncheckable, check_signature
from tests.common import make_config
from transforms.output.summary import RunSummary


@pytest.mark.parametrize("recorded", ["not json", "[1, 2]", "5", "null", '["max_tokens"]',
                                      "[[1]]"])
def test_a_recorded_signature_that_is_no_json_object_is_uncheckable(recorded):
    summary = RunSummary(run_id="r", incremental={"embedding_signature": recorded})
    with pytest.raises(OutputUncheckable):
        check_signature(make_config(), "out", summary)


@pytest.mark.parametrize("recorded", [5, ["max_tokens"], {"max_tokens": 1}, True])
def test_a_recorded_signature_that_is_not_a_string_is_uncheckable_not_skipped(recorded):
    summary = RunSummary(run_id="r", incremental={"embedding_signature": recorded})
    with pytest.raises(OutputUncheckable):
        check_signature(make_config(), "out", summary)


def test_a_summary_without_a_recorded_signature_is_still_searched():
    """What the fix must keep: a summary of a release before the signature was recorded (no
    key, or no ``incremental`` section) is not checked."""
    config = make_config()
    check_signature(config, "out", RunSummary(run_id="r"))
    check_signature(config, "out", RunSummary(run_id="r", incremental={"outputs_read": 0}))
