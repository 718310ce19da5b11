"""The floors under the publish lease and the clean-up ages, and the test suite's override of
them (``NEWSVEC_UNSAFE_TEST_TIMINGS``): below the config's schema (``sink.commit_lease_s``), the
lease (``transforms.output.lease``) and the commands that take ``--lease-s``, which all check
against them."""
from __future__ import annotations

import functools
import logging
import os

_LOG = logging.getLogger(__name__)

# The longest one storage request can take through Beam's GCS client: google-cloud-storage's
# default retry deadline (120 s), then the last attempt's own timeout (60 s).
SLOWEST_STORAGE_REQUEST_S = 180.0
# commit_lease_s, --lease-s: the holder stops at lease_s / 2 without a renewal, so a request it
# started just before must land before the taker can start, lease_s / 2 later.
MIN_LEASE_S = 2 * SLOWEST_STORAGE_REQUEST_S
# For the test suite only: set (to anything), leases and clean-up ages go below their floors. Not
# a setting of any config or command; every process that uses it logs a warning.
UNSAFE_TEST_TIMINGS_ENV = "NEWSVEC_UNSAFE_TEST_TIMINGS"


@functools.lru_cache(maxsize=1)
def _warn_unsafe_timings() -> None:
    _LOG.warning("%s is set: publish leases and clean-up ages may go below their floors. For "
                 "tests only: never set it where real outputs are published",
                 UNSAFE_TEST_TIMINGS_ENV)


def unsafe_test_timings() -> bool:
    """Whether the test suite's override of the floors is set (logged once per process)."""
    if os.environ.get(UNSAFE_TEST_TIMINGS_ENV):
        _warn_unsafe_timings()
        return True
    return False


def min_lease_s() -> float:
    """The shortest publish lease accepted: ``MIN_LEASE_S``, or any under the test override."""
    return 0.0 if unsafe_test_timings() else MIN_LEASE_S


def require_lease_s(lease_s: float, what: str = "the publish lease") -> float:
    if not lease_s > 0:
        raise ValueError(f"{what} must be positive, got {lease_s!r}")
    floor = min_lease_s()
    if lease_s < floor:
        raise ValueError(
            f"{what} is {lease_s:g} s, under its floor of {floor:g} s: a holder stops at half "
            f"its lease without a renewal, and a storage request it started just before may take "
            f"{SLOWEST_STORAGE_REQUEST_S:g} s (GCS retries) to land")
    return lease_s
