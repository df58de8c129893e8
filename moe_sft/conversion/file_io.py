"""What the streaming readers and the conversion CLIs share: cached read-only file descriptors
(reads are `os.preadv` of just the bytes needed, never a whole file) and a progress line."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


class OpenFiles:
    """One read-only descriptor per file, opened on first use, closed with the reader."""

    def __init__(self):
        self._fds: dict[Path, int] = {}

    def fd(self, file: Path) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


class Progress:
    """One stderr line every `every_s` seconds while bytes are written (none for small models)."""

    def __init__(self, what: str, every_s: float = 30.0):
        self.what, self.every_s = what, every_s
        self.started = self.last = time.time()

    def __call__(self, done: int, total: int) -> None:
        now = time.time()
        if now - self.last >= self.every_s:
            self.last = now
            rate = done / 1e6 / max(now - self.started, 1e-9)
            print(
                f"  {done / 1e9:.1f}/{total / 1e9:.1f} GB {self.what} ({100 * done / max(total, 1):.0f}%), "
                f"{rate:.0f} MB/s",
                file=sys.stderr,
                flush=True,
            )
