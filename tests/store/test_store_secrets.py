"""The connection string's secrets never show (issue 37 §3): each form of DSN that once leaked, or
could, through each way newsvec opens the store (a load, ``newsvec load``, ``newsvec search
--store``, ``newsvec ledger --store``), with every logger at DEBUG (psycopg's own included, which
names each host it tries): the password (and the hosts, where the form is about them) is in no
output, no log record and no formatted exception chain. No database is needed: nothing listens on
the DSN's port, so every connection fails, which is when messages quote the DSN."""
from __future__ import annotations

import logging
import traceback

import numpy as np
import pytest
import yaml

from tests.common import STORE_DSN_ENV, make_config
from tests.store.test_store_faults import DAY, rows
from tools.emulators import free_port
from transforms.stores.base import LoadRows
from transforms.stores.pgvector import StoreSettings, store_of

RUN_ID = "20261201T000000Z-00000000"

# name -> (DSN with {port} and {port2}, what must never show)
FORMS = {
    # libpq cannot parse it ('%' not followed by two hex digits): its message quotes the password
    "unparsable": ("postgresql://newsvec:Tr0ub4dor%zz3@127.0.0.1:{port}/news", ["Tr0ub4dor"]),
    "percent-encoded": ("postgresql://newsvec:p%40ss%21w0rd@127.0.0.1:{port}/news",
                        ["p%40ss%21w0rd", "p@ss!w0rd"]),
    "sslpassword": ("host=127.0.0.1 port={port} user=newsvec password=Pw9secret "
                    "sslpassword=KeyPassphrase1 dbname=news", ["KeyPassphrase1", "Pw9secret"]),
    "short password": ("host=127.0.0.1 port={port} user=newsvec password=Q7 dbname=news", ["Q7"]),
    "second host": ("host=127.0.0.1,db2.newsvec-secret.invalid port={port},{port2} user=newsvec "
                    "password=Multi9pw dbname=news", ["Multi9pw", "db2.newsvec-secret"]),
    "second host (URL)": ("postgresql://newsvec:Multi9pw@127.0.0.1:{port},"
                          "db2.newsvec-secret.invalid:{port2}/news",
                          ["Multi9pw", "db2.newsvec-secret"]),
    # a '/' not written as %2F: libpq reads the user as the host, the password's first part as
    # the port and its rest as the database name, none of which is scrubbed as a password
    "slash in a URL's password": ("postgresql://newsvec:Xy7Q/Kq9+Zt@127.0.0.1:{port}/news",
                                  ["Xy7Q", "Kq9+Zt"]),
}

PATHS = ["store load", "newsvec load", "search --store", "ledger --store"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("form", list(FORMS))
def test_no_secret_of_the_dsn_shows(form, path, monkeypatch, caplog, capsys, tmp_path):
    import pipeline.load
    import pipeline.search
    from pipeline import cli

    template, secrets = FORMS[form]
    dsn = template.format(port=free_port(), port2=free_port())
    monkeypatch.setenv(STORE_DSN_ENV, dsn)
    settings = StoreSettings(enabled=True, dsn_env=STORE_DSN_ENV, retry_s=0.2)
    out = tmp_path / "out"
    out.mkdir()
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(make_config(input="x", output=str(out),
                                                      store=settings).model_dump(mode="json")))
    # What is not under test: the run's rows, the query's embedding (no model needed).
    monkeypatch.setattr(pipeline.load, "run_rows",
                        lambda output, run_id: LoadRows(rows(["a"]), None, DAY))
    monkeypatch.setattr(pipeline.search, "embed_query",
                        lambda config, query: np.ones(8, np.float32))
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="psycopg")  # it names each host and port it tries

    chain, code = "", None
    try:
        if path == "store load":
            store_of(settings).load(LoadRows(rows(["a"]), None, DAY), "run:x")
        else:
            argv = {"newsvec load": ["load", "--config", str(config_file), "--run-id", RUN_ID],
                    "search --store": ["search", "--store", "--config", str(config_file), "q"],
                    "ledger --store": ["ledger", "--store", "--config", str(config_file)]}[path]
            code = cli.main(argv)
    except Exception as exc:  # pylint: disable=broad-except  # its whole chain is checked
        chain = "".join(traceback.format_exception(exc))
        assert exc.__cause__ is None and exc.__context__ is None, chain
    printed = capsys.readouterr()
    shown = chain + printed.out + printed.err + caplog.text + "".join(
        f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    for secret in secrets:
        assert secret not in shown, f"{secret!r} shows:\n{shown}"
    if path == "store load":
        assert chain, "the load did not fail"
    else:  # a command fails with its message on stderr and status 1, not with a traceback
        assert code == 1 and not chain, chain
        assert "store" in printed.err


@pytest.mark.parametrize("dsn", [
    "postgresql://newsvec:Xy7Q/Kq9+Zt@db.internal/news",  # a '/' in the password
    "postgres://newsvec:p@ss@db.internal/news",  # an '@' in the password
])
def test_a_url_libpq_would_misread_is_refused_with_the_fixed_message(dsn):
    """libpq reads the user of such a URL as the host, and the password's parts as the port, the
    database name or a host: it would connect with them, and name them where it names a port or a
    database, unscrubbed. Before: the DSN was taken, its password parts left to libpq."""
    from transforms.stores.base import StoreError
    from transforms.stores.pgvector import UNPARSABLE_DSN, Store

    with pytest.raises(StoreError) as refused:
        Store(StoreSettings(enabled=True), dsn=dsn)
    assert str(refused.value) == f"store: {UNPARSABLE_DSN}"
    assert "%2F" in UNPARSABLE_DSN and "%40" in UNPARSABLE_DSN


@pytest.mark.parametrize("dsn", [
    "postgresql://newsvec:p%2Fss%40w0rd@db.internal/news?sslmode=require",
    "postgresql://newsvec@db.internal/news?password=a/b@c",  # the query is not the userinfo
    "host=db.internal user=newsvec password=a/b@c@d dbname=news",
])
def test_a_url_written_right_is_taken(dsn):
    from transforms.stores.pgvector import Store

    Store(StoreSettings(enabled=True), dsn=dsn)


class _Response:
    def __init__(self, status_code, body, reason="Forbidden"):
        self.status_code, self._body, self.reason = status_code, body, reason

    def json(self):
        import json

        return json.loads(self._body)


def _secret_manager(monkeypatch, response) -> list:
    """Secret Manager's REST API faked: what was asked of it."""
    import google.auth
    import google.auth.transport.requests

    asked: list = []

    class Session:
        def __init__(self, credentials):
            pass

        def get(self, url, timeout):
            asked.append((url, timeout))
            return response

    monkeypatch.setattr(google.auth, "default", lambda scopes: ("credentials", "p"))
    monkeypatch.setattr(google.auth.transport.requests, "AuthorizedSession", Session)
    return asked


SECRET = "projects/news-prod/secrets/newsvec-dsn/versions/latest"


def test_the_dsn_is_read_from_secret_manager_at_run_time(monkeypatch, tmp_path):
    """On Dataflow the DSN is neither in the image nor in the job's options: the worker reads it
    from Secret Manager with its service account. It wins over dsn_file and dsn_env. Before: a
    config had no such key (``store.dsn_secret`` was refused)."""
    import base64

    from transforms.stores.pgvector import resolve_dsn

    dsn = "host=10.1.2.3 user=newsvec password=Fr0m-SecretMgr dbname=news"
    payload = base64.b64encode(dsn.encode() + b"\n").decode()
    asked = _secret_manager(monkeypatch, _Response(200, f'{{"payload": {{"data": "{payload}"}}}}'))
    monkeypatch.setenv(STORE_DSN_ENV, "host=elsewhere")
    (tmp_path / "dsn").write_text("host=elsewhere-too")
    settings = StoreSettings(enabled=True, dsn_env=STORE_DSN_ENV, dsn_file=str(tmp_path / "dsn"),
                             dsn_secret=SECRET)
    assert resolve_dsn(settings) == dsn
    assert asked == [(f"https://secretmanager.googleapis.com/v1/{SECRET}:access", 30)]
    with pytest.raises(Exception, match="dsn_secret"):
        StoreSettings(dsn_secret="newsvec-dsn")  # a secret version's full name only


@pytest.mark.parametrize("response,expected", [
    (_Response(403, '{"error": {"message": "Permission denied on secretmanager.versions.access"}}'),
     "HTTP 403: Permission denied"),
    (_Response(200, '{"payload": {"data": "!!not base64 Pw-in-body!!"}}'), "not a UTF-8"),
    (_Response(502, "<html>Pw-in-body</html>", reason="Bad Gateway"), "HTTP 502: Bad Gateway"),
])
def test_a_secret_that_cannot_be_read_says_why_and_never_quotes_the_body(monkeypatch, response,
                                                                          expected):
    from transforms.stores.base import StoreError
    from transforms.stores.pgvector import resolve_dsn

    _secret_manager(monkeypatch, response)
    with pytest.raises(StoreError) as failed:
        resolve_dsn(StoreSettings(enabled=True, dsn_secret=SECRET))
    assert expected in str(failed.value) and SECRET in str(failed.value)
    assert "Pw-in-body" not in "".join(traceback.format_exception(failed.value))
    assert failed.value.__context__ is None and failed.value.__cause__ is None


@pytest.mark.parametrize("job", ["batch", "streaming"])
def test_a_dataflow_job_with_the_store_on_and_no_dsn_secret_is_refused_at_launch(tmp_path, job):
    """On Dataflow the store is loaded on the workers (the batch load step, the streaming writer),
    which have neither the launcher's environment variable (``store.dsn_env``) nor its file
    (``store.dsn_file``). Before, such a batch job embedded the whole day and then failed on
    every worker; the launch is refused instead, saying what to set (nothing is submitted: the
    refusal comes first). With ``store.dsn_secret``, or on a local runner, it resolves."""
    from pipeline import config as config_lib
    from pipeline.run import resolve

    raw = yaml.safe_load((config_lib.REPO_ROOT / "configs" / "local.yaml").read_text())
    raw["store"] = {"enabled": True, "dsn_env": STORE_DSN_ENV}
    if job == "streaming":
        raw = {**raw, "input": None,
               "streaming": {"subscription": "projects/p/subscriptions/news"}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    dataflow = ["--runner=DataflowRunner", "--project=p", "--region=europe-west4",
                "--temp_location=gs://b/tmp"]
    with pytest.raises(config_lib.ConfigError, match=r"store\.enabled on Dataflow needs "
                                                     r"store\.dsn_secret"):
        resolve(["--config", str(path), *dataflow])
    assert resolve(["--config", str(path), "--runner=FnApiRunner"])[0].store.enabled
    raw["store"]["dsn_secret"] = SECRET
    path.write_text(yaml.safe_dump(raw))
    assert resolve(["--config", str(path), *dataflow])[0].store.dsn_secret == SECRET
