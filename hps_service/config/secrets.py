"""Secrets from mounted files: the ``*_file`` twins of the config's secret keys, and files watched for rotation.

A Kubernetes Secret mounted as a volume is a file per key, replaced in place (through a symlink swap) when the
Secret changes; environment variables from a Secret would only change with a restart and are inherited by every
child process. A secret file holds the value alone; one trailing newline (as ``echo`` or an editor leaves it) is
not part of it. No function here logs or returns a secret in an error message.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from pydantic import BaseModel, SecretStr

log = logging.getLogger(__name__)

#: Largest secret file read (a token, a password, a key: a few hundred bytes; a PEM bundle a few KiB).
MAX_SECRET_BYTES = 64 << 10


class SecretFileError(ValueError):
    """A secret file cannot be read, is empty or too large; the message names the key and the path, never the value."""


def read_secret(path: Path, what: str) -> str:
    """The secret in ``path`` (without one trailing newline); SecretFileError naming ``what`` when unusable."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise SecretFileError(f"{what} {path} cannot be read: {exc.strerror or type(exc).__name__}") from None
    if len(data) > MAX_SECRET_BYTES:
        raise SecretFileError(f"{what} {path} is larger than {MAX_SECRET_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SecretFileError(f"{what} {path} is not UTF-8 text") from None
    text = text.removesuffix("\n").removesuffix("\r")
    if not text:
        raise SecretFileError(f"{what} {path} is empty")
    return text


def load_secret_files(section: BaseModel, prefix: str, *names: str) -> None:
    """For each secret field ``name`` of ``section`` with a ``<name>_file`` twin: read the file into the field.
    Giving both is refused (which one wins would be a guess). ``prefix`` names the section in messages."""
    for name in names:
        path = getattr(section, f"{name}_file")
        if path is None:
            continue
        if getattr(section, name) is not None:
            raise ValueError(f"set {prefix}.{name} or {prefix}.{name}_file, not both")
        setattr(section, name, SecretStr(read_secret(path, f"{prefix}.{name}_file")))


def file_signature(path: Path) -> tuple[int, int, int, int] | None:
    """What changes when a file is replaced or rewritten: (device, inode, size, mtime ns); None when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


_reported_lock = threading.Lock()
#: Per secret file, the state last logged in this process (several watchers of one file log a change once).
_reported: dict[Path, str | None] = {}


def _report(path: Path, what: str, error: str | None) -> None:
    """Log a watched file's change of state once per process: unusable (``error``, which names the key and the path,
    never the value), or usable again."""
    with _reported_lock:
        before = _reported.get(path)
        if before == error:
            return
        _reported[path] = error
    if error is not None:
        log.warning("%s: no secret until the file holds one again (whatever it held before is refused)", error)
    else:
        log.info("%s %s holds a secret again", what, path)


class WatchedSecret:
    """A secret that follows its file: :meth:`get` re-reads it when the file changed, looking at most every
    ``check_every_s`` (one ``stat``), so a rotated Secret takes effect without a restart. It fails closed: a file
    that is gone, empty or unreadable now means no secret (None) until it holds one again, so deleting or emptying a
    token's file revokes the token. A Kubernetes Secret is swapped whole (a symlink swap), never seen half-written.
    Each change of state is logged once, naming the key and the path, never the value; ``error`` keeps why."""

    def __init__(self, path: Path, what: str, check_every_s: float = 1.0) -> None:
        self.path = Path(path)
        self.what = what
        self.check_every_s = check_every_s
        self._signature = file_signature(self.path)
        self._value: str | None = read_secret(self.path, what)
        self._checked = time.monotonic()
        self._lock = threading.Lock()
        self.error: str | None = None
        #: Bumped on every change of value, so holders of derived state (digests) know to rebuild it.
        self.generation = 0

    def get(self) -> str | None:
        """The secret the file holds now, or None when it holds none (gone, empty, unreadable)."""
        now = time.monotonic()
        if now - self._checked >= self.check_every_s:
            with self._lock:
                if now - self._checked >= self.check_every_s:
                    self._checked = now
                    self._reload()
        return self._value

    def _reload(self) -> None:
        signature = file_signature(self.path)
        if signature == self._signature:
            return
        self._signature = signature
        try:
            value: str | None = read_secret(self.path, self.what)
            error = None
        except SecretFileError as exc:
            value, error = None, str(exc)
        self.error = error
        _report(self.path, self.what, error)
        if value != self._value:
            self._value = value
            self.generation += 1
