"""Values built from files and built again when the files change (the services'
certificates, keys and trusted CA bundle, and the revocation list), and writing such
files so that a reader never sees part of one.

A change is seen by ``stat``: inode, device, modification time and size. That is cheap
enough to ask on every TLS handshake and every call, and it notices the three ways
files are replaced in practice: rewritten in place, renamed over (``ztate ca renew``,
most editors) and a symlink swapped (Kubernetes secrets and ConfigMaps, cert-manager,
SPIRE's helper). A rebuild that fails (a file half written, a certificate that does not
match its key yet) keeps the previous value and is tried again at the next change of
the files' stamps; it is logged once per stamp, with the error's type and no content.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

log = logging.getLogger("ztate.reloading")
Value = TypeVar("Value")
Stamp = tuple[tuple[int, int, int, int] | None, ...]


def stamp(paths: Sequence[Path]) -> Stamp:
    """What identifies the current content of ``paths`` without reading it (None: absent,
    or not to be stat'ed: a symlink loop, a folder that cannot be searched, a name too
    long). Never raises: whoever reads the files next says why they cannot be read
    (``WatchedFiles`` keeps its value, the console answers CREDENTIALS_UNREADABLE)."""
    found: list[tuple[int, int, int, int] | None] = []
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:
            found.append(None)
        else:
            found.append((info.st_ino, info.st_dev, info.st_mtime_ns, info.st_size))
    return tuple(found)


class WatchedFiles(Generic[Value]):
    """``build()`` over ``paths``, built at construction (its errors are the caller's: a
    service must not start on files it cannot use) and again whenever a stamp changes.

    Safe to call from several threads: gRPC asks for server certificates on its own.
    """

    def __init__(self, what: str, paths: Sequence[Path], build: Callable[[], Value]) -> None:
        self._what = what
        self._paths = tuple(paths)
        self._build = build
        self._lock = threading.Lock()
        self._stamp = stamp(self._paths)
        self._value = build()
        self._failed: Stamp | None = None

    @property
    def value(self) -> Value:
        """The value as last built (``refresh`` first to see changes)."""
        return self._value

    def refresh(self) -> bool:
        """Rebuild if the files changed since the last build; True when a new value was
        taken, False when nothing changed or the rebuild failed (the old value stays)."""
        now = stamp(self._paths)
        # unchanged since the last build, or since the last build that failed (a broken
        # file is not read and parsed again at every call: it is tried again when it
        # changes)
        if now in (self._stamp, self._failed):
            return False
        with self._lock:
            if now in (self._stamp, self._failed):  # another thread tried meanwhile
                return False
            try:
                value = self._build()
            except Exception as failure:  # any failure keeps the old value
                # (OSError, ValueError, and what a parser of hostile bytes may raise besides:
                # RecursionError, MemoryError): a file that breaks must not fail every call
                self._failed = now
                log.warning(
                    "%s changed but cannot be loaded (%s): keeping the previous one",
                    self._what,
                    type(failure).__name__,
                )
                return False
            self._value, self._stamp, self._failed = value, now, None
        log.info("reloaded %s", self._what)
        return True

    def current(self) -> Value:
        """The value, rebuilt first if the files changed."""
        self.refresh()
        return self._value


def write_atomically(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` with ``data`` so that a reader sees the old file or the new one,
    never part of one: a temporary file in the same folder, synced, then renamed over.
    The file has ``mode`` from its first byte (0600 for a private key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
