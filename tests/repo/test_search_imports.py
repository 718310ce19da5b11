"""``newsvec search`` imports what it uses: the command (``pipeline.cli``, ``pipeline.search``)
and its query path (the config's embedding signature checked against the output's, the query
embedded without the engine) bring in neither torch, vLLM nor Beam's ``apache_beam.ml``. Before,
the signature came from ``pipeline.graph``, whose ``transforms.embed`` imports
``apache_beam.ml.inference.base`` and with it torch: 0.8 s of a 3 s search. In a fresh process,
so that what another test imported does not count."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.common import REPO

SEARCH = """
import json, sys
import pipeline.cli
import pipeline.search as search
from pipeline import config as config_lib
from transforms.output.summary import RunSummary

config = config_lib.load(config_lib.DEFAULT_CONFIG)
recorded = RunSummary(incremental={"embedding_signature": config_lib.signature_of(config)})
search.check_signature(config, "out", recorded)
vectors, notes = search.embed_queries(config, ["a query"])
assert not notes, notes
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "vllm")
                        or name == "apache_beam.ml" or name.startswith("apache_beam.ml."))))
"""


def test_a_search_imports_neither_torch_nor_vllm_nor_beams_ml():
    done = subprocess.run([sys.executable, "-c", SEARCH], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
