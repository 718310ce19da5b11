"""``newsvec ledger --store`` compares each vectors file a ledger record names with the store's
rows, the file's day read from its ``dt=`` folder (``layout.day_of_path``). A record may name
files only under its own partition (``compaction.record_files``), but that partition is the
folder the record lies in, whatever its name: whoever can write the output can plant
``ledger/dt=2026-02-30/hour=00/<record>.json`` naming a vectors file of
``vectors/dt=2026-02-30/hour=00/``. ``day_of_path`` raises ``ValueError`` for such a folder, and
the check ends in a traceback (``day is out of range for month``) instead of naming the file as
a problem and checking the rest."""
from __future__ import annotations

import pyarrow as pa

from transforms.output.ledger_check import _StoreCheck


class _NoRows:
    def rows(self, ids):
        return {}


def test_a_vectors_file_under_a_dt_folder_that_is_no_day_does_not_end_the_check():
    found = _StoreCheck()
    table = pa.table({"id": ["a"], "text_sha256": ["s"]})
    found.compare_file(_NoRows(), "vectors/dt=2026-02-30/hour=00/"
                       "part-20260228T000000Z-000-00000-of-00001-0123456789abcdef.parquet",
                       table, set())  # today: ValueError: day is out of range for month
    assert found.problems({}) == [
        "vectors/dt=2026-02-30/hour=00/part-20260228T000000Z-000-00000-of-00001-0123456789abcdef"
        ".parquet: its dt= folder is no day: not compared with the store"]
