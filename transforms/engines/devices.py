"""The GPUs of a worker, and which one each SDK process's shared engine runs on
(``model.gpus_per_worker``, with ``model.share_across_processes``).

A worker with N GPUs runs N shared engines, one per GPU, each in a process of its own that sees
only its device (``CUDA_VISIBLE_DEVICES`` set in that process before vLLM or torch is imported, so
vLLM's ``cuda:0`` is that GPU). Each SDK process uses one of them, for as long as it lives.

Which one: ``DeviceSlots``, a small file per machine and step that lists the live SDK processes
and the engine each was given, read and rewritten under a file lock. A process that asks is given
the engine with the fewest live processes (the lowest index on a tie), so 8 processes over 2 GPUs
are 4 and 4 whatever their pids and whatever order they start in. A process that died is dropped
from the list the next time any process asks, so the one that replaces it (Dataflow restarts a
crashed SDK process) fills the gap it left. Processes already placed never move: an engine's
process holds its model, and moving a client would only shift load for a while.

A deterministic slot (pid % N) was the alternative: no file, but pids are not consecutive, so two
processes of four may well share a GPU while the other idles, and a restarted process lands
anywhere.

Nothing here initializes CUDA: the SDK processes never touch the GPU. ``resolved_dtype`` (the
dtype ``model.dtype: native`` runs at on this machine) asks torch only where a GPU is visible.
"""
from __future__ import annotations

import functools
import glob
import json
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Optional

from transforms.private_files import ensure_private_file, read_private, write_private
from transforms.settings import ModelSettings

_LOG = logging.getLogger(__name__)
# Where Dataflow's install-nvidia-driver puts the driver's tools in the SDK container.
_NVIDIA_SMI_DIRS = ("/usr/local/nvidia/bin",)


def visible_gpus() -> list[str]:
    """The CUDA devices this process may use, as ``CUDA_VISIBLE_DEVICES`` entries: the entries
    of ``CUDA_VISIBLE_DEVICES`` where it is set (indexes or UUIDs; empty: none), else one index
    per GPU that ``nvidia-smi -L`` lists, else per ``/dev/nvidiaN`` device file; [] on a machine
    without GPUs (or whose GPUs nothing here can see)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        entries = [e.strip() for e in env.split(",")]
        # CUDA ignores every entry from the first invalid one on ("-1" is the usual "none").
        valid = []
        for entry in entries:
            if not entry or entry.startswith("-"):
                break
            valid.append(entry)
        return valid
    count = _nvidia_smi_count()
    if count is None:
        count = len([d for d in glob.glob("/dev/nvidia*") if re.fullmatch(r"nvidia\d+",
                                                                       os.path.basename(d))])
    return [str(i) for i in range(count)]


def _nvidia_smi_count() -> Optional[int]:
    """GPUs ``nvidia-smi -L`` lists ("GPU 0: NVIDIA L4 (UUID: ...)" lines; MIG instances under
    a GPU are not counted apart); None when there is no nvidia-smi, or it fails."""
    path = shutil.which("nvidia-smi") or shutil.which(
        "nvidia-smi", path=os.pathsep.join(_NVIDIA_SMI_DIRS))
    if not path:
        return None
    try:
        listed = subprocess.run([path, "-L"], capture_output=True, text=True, timeout=30,
                                check=True).stdout
    except (OSError, subprocess.SubprocessError):
        _LOG.warning("nvidia-smi -L failed; counting /dev/nvidiaN instead", exc_info=True)
        return None
    return sum(1 for line in listed.splitlines() if re.match(r"GPU \d+:", line))


def resolved_dtype(settings: ModelSettings) -> str:
    """The dtype the engine runs at on this machine: ``model.dtype``, or for ``native`` bfloat16
    where the hardware computes it (``_computes_bfloat16``), else float32."""
    if settings.dtype != "native":
        return settings.dtype
    return "bfloat16" if _computes_bfloat16() else "float32"


@functools.lru_cache(maxsize=1)
def _computes_bfloat16() -> bool:
    """A CUDA GPU with bfloat16 (torch is asked only where ``visible_gpus`` finds a GPU), or a CPU
    with AVX512_BF16 or AMX-BF16 (Linux: /proc/cpuinfo). Elsewhere bfloat16 is emulated: measured
    on an AMD EPYC without AVX-512, 2.2 articles/s at bfloat16 against 13.9 at float32."""
    if visible_gpus():  # torch only where a GPU may answer: importing it takes 1.5 s on a CPU
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.is_bf16_supported()
        except ImportError:
            pass
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def engine_devices(settings: ModelSettings) -> list[Optional[str]]:
    """One entry per shared engine of this machine: the ``CUDA_VISIBLE_DEVICES`` its process
    gets, or None for a single engine left as it is (one GPU, or none: today's one engine).

    ``gpus_per_worker: auto`` takes every GPU the worker sees. A number takes that many of them;
    on a machine where none can be seen (no driver tools, a CPU test), it is taken on trust as
    indexes 0..N-1; a machine that sees some but fewer is a config error, raised here."""
    visible = visible_gpus()
    wanted = settings.gpus_per_worker
    if wanted == "auto":
        n = max(1, len(visible))
    else:
        n = int(wanted)
        if visible and len(visible) < n:
            raise ValueError(f"model.gpus_per_worker is {n} but this worker sees "
                             f"{len(visible)} GPU(s): {','.join(visible)}")
        if len(visible) > n:
            _LOG.warning("model.gpus_per_worker is %d: %d of this worker's %d GPUs stay idle",
                         n, len(visible) - n, len(visible))
    if n == 1:
        return [None]
    return list(visible[:n]) if visible else [str(i) for i in range(n)]


class DeviceSlots:
    """The per-machine list of live SDK processes and the engine each was given (see the module's
    docstring): ``{folder}/{tag}.devices``, a JSON object {"<pid> <start time>": engine index},
    changed only under ``{tag}.devices.lock``, in the engine's private folder
    (``transforms.private_files``: written 0600 through a temp file of a random name, read only
    if it is this user's and no one else's). ``alive`` tells whether a listed process still
    lives (its pid and start time: a pid may be reused)."""

    def __init__(self, folder: str, tag: str, alive: Callable[[tuple[int, int]], bool]):
        self.path = os.path.join(folder, f"{tag}.devices")
        self._lock_path = self.path + ".lock"
        self._alive = alive

    def assign(self, process: tuple[int, int], engines: int) -> int:
        """The engine index for ``process``: the one it was given before, or the one with the
        fewest live processes."""
        import fasteners

        key = f"{process[0]} {process[1]}"
        ensure_private_file(self._lock_path)
        with fasteners.InterProcessLock(self._lock_path):
            table = self._read()
            table = {k: i for k, i in table.items()
                     if 0 <= i < engines and (k == key or self._alive(_parse(k)))}
            if key not in table:
                load = [0] * engines
                for index in table.values():
                    load[index] += 1
                table[key] = load.index(min(load))
            write_private(self.path, json.dumps(table).encode())
            return table[key]

    def counts(self, engines: int) -> list[int]:
        """Live processes per engine, as the file says now (for logs and tests)."""
        load = [0] * engines
        for key, index in self._read().items():
            if 0 <= index < engines and self._alive(_parse(key)):
                load[index] += 1
        return load

    def _read(self) -> dict[str, int]:
        data = read_private(self.path)  # not another user's, not through a symlink
        try:
            table = json.loads(data) if data is not None else {}
        except ValueError:
            return {}  # none yet, or unreadable: start afresh (processes are placed again)
        if not isinstance(table, dict):
            return {}
        return {k: v for k, v in table.items()
                if isinstance(v, int) and re.fullmatch(r"\d+ \d+", str(k))}


def _parse(key: str) -> tuple[int, int]:
    pid, started = key.split()
    return int(pid), int(started)
