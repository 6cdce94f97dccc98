"""The trust checks of the embedded Redis (:mod:`scrapy_dist.redis.embedded`): directories only we can
change (checked, never repaired), private files created ``O_EXCL|O_NOFOLLOW`` and renamed into place, and
the short socket path for a deep directory. The threat model and each rule: docs/security.md, "The
embedded Redis"."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from scrapy_dist.exceptions import RedisUnavailable

__all__ = [
    "check_private_dir", "make_private_dir", "private_secret", "read_private", "unsafe", "write_private",
]


def unsafe(message: str) -> RedisUnavailable:
    """The one-line error for a directory or file we cannot trust."""
    return RedisUnavailable(message + "; or set REDIS_URL to use another Redis")


def check_private_dir(path: Path) -> None:
    """Raise :class:`RedisUnavailable` (one line naming the directory and the fix) unless ``path`` is a
    directory that only this user can change: a real directory (no symlink), owned by us, not writable by
    group or others; and every parent owned by us or root and not writable by others unless sticky."""
    uid = os.geteuid()
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise unsafe(f"The embedded Redis directory {path} cannot be used ({exc.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise unsafe(
            f"The embedded Redis directory {path} is a symlink; point REDIS_EMBEDDED_DIR at the real "
            "directory or remove the link"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise unsafe(f"The embedded Redis directory {path} is not a directory; remove it")
    if st.st_uid != uid:
        raise unsafe(
            f"The embedded Redis directory {path} belongs to uid {st.st_uid}, not to you (uid {uid}): "
            "someone else may control it; remove it (or use another REDIS_EMBEDDED_DIR)"
        )
    if st.st_mode & 0o022:
        raise unsafe(
            f"The embedded Redis directory {path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run: chmod go-w {path}"
        )
    for parent in path.parents:
        try:
            pst = os.stat(parent)
        except OSError:
            continue
        sticky = bool(pst.st_mode & stat.S_ISVTX)
        if pst.st_uid not in (uid, 0) and not sticky:
            raise unsafe(
                f"The embedded Redis directory {path} is inside {parent}, which belongs to uid "
                f"{pst.st_uid}: they could replace it; use a REDIS_EMBEDDED_DIR inside a directory of yours"
            )
        if pst.st_mode & 0o002 and not sticky:
            raise unsafe(
                f"The embedded Redis directory {path} is inside {parent}, which anyone can write; "
                f"run: chmod o-w {parent} (or use another REDIS_EMBEDDED_DIR)"
            )


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) with mode 0700 if missing -- never chmod an existing one --
    then check it (see :func:`check_private_dir`)."""
    missing = []
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
    check_private_dir(path)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable only by us: a fresh file (``O_EXCL|O_NOFOLLOW``,
    mode 0600, random name) renamed over ``path`` -- a symlink planted at either name is never followed."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_private(path: Path) -> str | None:
    """The text of ``path`` if it is a regular file of ours that nobody else can read or write (opened
    with ``O_NOFOLLOW``), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None
        return fh.read(65536).decode("utf-8", "replace")


def private_secret(path: Path) -> bytes:
    """The random secret kept in ``path`` (in a private directory), made on first use: 32 random bytes as
    hex, written to a fresh file (``O_EXCL|O_NOFOLLOW``, mode 0600) and linked into place, so two processes
    starting at once agree on one secret. A file at ``path`` that is not private (see
    :func:`read_private`) or holds too little is refused in one line."""
    text = read_private(path)
    if text is None and not os.path.lexists(path):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_hex(32))
            with contextlib.suppress(FileExistsError):  # another process made it first: its secret wins
                os.link(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        text = read_private(path)
    secret = (text or "").strip()
    if len(secret) < 32:
        raise unsafe(
            f"The embedded Redis's entry secret {path} is not a private file of yours with a secret in it;"
            " remove it (a new one is made)"
        )
    return secret.encode()
