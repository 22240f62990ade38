"""Same-host KV transport: one file per block in a tmpfs directory (/dev/shm).

Writers fill a temporary file and `os.replace` it into place, so readers see either no file or
the whole value. A key's expiry time is the file's mtime, which lets every process on the host
share expiry without any server: a file whose mtime is in the past counts as missing, `touch`
moves the mtime forward, and `put_many` sweeps expired files at most once a second.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

from specmesh.shared.transport.base import KVTransport

_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# Keys become file names: no separators, and no leading dot (temporary files start with one).
_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_SWEEP_INTERVAL_S = 1.0
# A temporary file this old was left by a writer that died between write and rename.
_STALE_TMP_S = 60.0


def _default_root() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


class ShmTransport(KVTransport):
    """Blocks as files in `<root>/specmesh-<namespace>/`, shared by all processes on the host.

    Concurrent use is safe without locks: renames are atomic and a reader holds the inode it
    opened even if a sweep unlinks the name. A sweep may delete a key that another process
    rewrote just after the sweep saw it expired; that costs a recompute, never wrong data.
    """

    def __init__(self, namespace: str, root: str | os.PathLike[str] | None = None) -> None:
        if not _NAME.fullmatch(namespace):
            raise ValueError(
                f"shm kv namespace {namespace!r} may only contain letters, digits, '_', '.', '-'"
            )
        super().__init__()
        self.dir = Path(root if root is not None else _default_root()) / f"specmesh-{namespace}"
        self._ensure_dir()
        self._last_sweep = 0.0
        self._sweep_lock = threading.Lock()

    def _ensure_dir(self) -> None:
        """Create the namespace directory 0700, or check that the one there is ours: on a
        shared /dev/shm, another user could have made it first to read or plant blocks."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.dir, 0o700)
        st = os.lstat(self.dir)
        problem = (
            "is not a directory (a symlink?)"
            if not stat.S_ISDIR(st.st_mode)
            else f"belongs to uid {st.st_uid}, not us ({os.getuid()})"
            if st.st_uid != os.getuid()
            else f"has mode {stat.S_IMODE(st.st_mode):o}; others may write it"
            if st.st_mode & 0o022
            else None
        )
        if problem:
            raise PermissionError(f"refusing the shm kv directory {self.dir}: it {problem}")
        if st.st_mode & 0o077:  # ours, but readable by others (made before this check)
            os.chmod(self.dir, 0o700)

    def _path(self, key: str) -> str:
        if not _KEY.fullmatch(key):
            raise ValueError(f"kv key {key!r} is not a valid file name")
        return os.path.join(self.dir, key)

    def put_many(self, items: dict[str, bytes], ttl_s: float) -> None:
        expiry = time.time() + ttl_s
        written = 0
        self._ensure_dir()  # in case someone cleared /dev/shm meanwhile
        for key, value in items.items():
            path = self._path(key)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{key}.")
            try:
                with open(fd, "wb") as f:
                    f.write(value)
                # mtime before the rename, so the file appears with its expiry already set.
                os.utime(tmp, (expiry, expiry))
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            written += len(value)
        self._count(written=written)
        self._maybe_sweep()

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        now = time.time()
        out: list[bytes | None] = []
        read = 0
        for key in keys:
            try:  # never through a link: a planted one could point anywhere
                fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW)
            except OSError as e:
                if not isinstance(e, FileNotFoundError) and e.errno != errno.ELOOP:
                    raise
                out.append(None)  # missing, or a link: recomputed
                continue
            f = open(fd, "rb", buffering=0)
            with f:
                # fstat of the open file: the expiry belongs to exactly the bytes read below.
                if os.fstat(f.fileno()).st_mtime < now:
                    out.append(None)
                    continue
                # readall() sizes one bytes object from fstat and fills it: measured as fast
                # as os.read, and faster than readinto() a bytearray plus the copy to bytes.
                data = f.readall()
            out.append(data)
            read += len(data)
        self._count(read=read)
        return out

    def _expiry(self, key: str) -> float | None:
        try:
            return os.stat(self._path(key), follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return None

    def count_present(self, keys: list[str]) -> int:
        now = time.time()
        n = 0
        for key in keys:
            expiry = self._expiry(key)
            if expiry is None or expiry < now:
                break
            n += 1
        return n

    def touch(self, keys: list[str], ttl_s: float) -> None:
        now = time.time()
        expiry = now + ttl_s
        for key in keys:
            current = self._expiry(key)
            if current is None or current < now:
                continue  # expired keys stay expired, as in redis
            with contextlib.suppress(FileNotFoundError):
                os.utime(self._path(key), (expiry, expiry), follow_symlinks=False)

    def delete_many(self, keys: list[str]) -> None:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(key))

    def _maybe_sweep(self) -> None:
        """Delete expired files (nothing else frees tmpfs memory), at most once a second."""
        now = time.time()
        with self._sweep_lock:
            if now - self._last_sweep < _SWEEP_INTERVAL_S:
                return
            self._last_sweep = now
        with os.scandir(self.dir) as entries:
            for entry in entries:
                try:
                    mtime = entry.stat().st_mtime
                    # A temporary file's mtime is its last write, not an expiry.
                    limit = now - _STALE_TMP_S if entry.name.startswith(".") else now
                    if mtime < limit:
                        os.unlink(entry.path)
                except FileNotFoundError:
                    continue

    def clear(self) -> None:
        with os.scandir(self.dir) as entries:
            for entry in entries:
                if not entry.name.startswith("."):  # a writer's temporary file is its own
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)

    def close(self) -> None:
        """Nothing to release: no handles stay open between calls."""

    def remove_all(self) -> None:
        """Delete the namespace directory and every block in it (on shutdown)."""
        shutil.rmtree(self.dir, ignore_errors=True)
