"""``python -m tests.serve.slow_server OUTPUT PORT_FILE``: ``newsvec serve``'s ``run`` (uvicorn,
its signal handling and draining) with a stand-in engine whose every call takes 2 s, on a free
loopback port written to PORT_FILE: the process the SIGTERM test stops."""
from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import numpy as np

from pipeline import config as config_lib
from pipeline.serve import main as serve_main
from pipeline.serve.main import run

CALL_S = 2.0
serve_main.HEADER_TIMEOUT_S = 3.0  # the slowloris test waits for it


class Slow:
    def label(self) -> str:
        return "slow@test"

    def embed(self, prompts):
        time.sleep(CALL_S)
        return [np.full(384, 384 ** -0.5, np.float32) for _ in prompts]


def main(output: str, port_file: str) -> int:
    base = config_lib.load(config_lib.DEFAULT_CONFIG)
    config = base.model_copy(update={
        "output": output, "model": base.model.model_copy(update={"dtype": "float32"})})
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    Path(port_file).write_text(str(sock.getsockname()[1]))
    return run(config, Slow(), sock)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
