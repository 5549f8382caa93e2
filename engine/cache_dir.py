"""Entries of the cache under ``$SPECFLEET_CACHE`` (default ``~/.cache/specfleet``), each made once across
processes: a GGUF file converted to a safetensors folder (or its metadata alone), a normalized config.json.

On a cold cache several processes ask for one entry at once: the API server loads the tokenizer while the
engine core loads the weights, tensor- and pipeline-parallel workers read the config, `specfleet up` starts
engines together. `ensure_folder` and `ensure_file` make an entry single-flight and atomic:

- an exclusive ``flock`` on ``.<name>.lock`` beside the target serializes the makers of one key (the kernel
  drops it when its holder dies, so a crash never leaves it held; the lock file itself is never removed);
- under the lock the target is checked again, so whoever waited finds it made and makes nothing;
- the maker writes into a fresh ``.<name>.partial-*`` beside the target, fsyncs it and renames it onto the
  target: the rename is the commit point, so a reader sees the whole entry or none (a folder also carries a
  marker file, written before the rename, that says it is whole);
- a finished target is never removed or replaced. Partial entries that a crashed maker left behind (and a
  folder without its marker, from before this module) are removed by the next maker, under the lock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("specfleet.engine.cache")

_HINT = "set SPECFLEET_CACHE to a writable folder"


class CacheError(OSError):
    """The cache itself could not be written (its folder, lock or rename); the maker's own errors pass as is."""


def cache_root() -> Path:
    return Path(os.environ.get("SPECFLEET_CACHE", Path.home() / ".cache" / "specfleet"))


def ensure_folder(target: Path, fill: Callable[[Path], object], marker: str) -> Path:
    """`target`, a folder that `fill(folder)` writes whole, made once across processes. `fill` gets an empty
    folder beside the target and must write the file `marker` in it (last): a folder holding it is whole."""

    def make(partial: Path) -> None:
        partial.mkdir()
        fill(partial)
        if not (partial / marker).is_file():
            raise RuntimeError(f"cache entry {target}: its maker wrote no {marker}")

    return _ensure(target, make, lambda: (target / marker).is_file())


def ensure_file(target: Path, write: Callable[[Path], object]) -> Path:
    """`target`, a file that `write(path)` writes whole, made once across processes (`path` is beside it)."""
    return _ensure(target, write, target.is_file)


def _ensure(target: Path, make: Callable[[Path], object], whole: Callable[[], bool]) -> Path:
    if whole():  # the warm path: no lock, nothing written (a read-only cache that holds the entry works)
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheError(
            exc.errno, f"cannot create the cache folder {target.parent} ({_HINT}): {exc}"
        ) from exc
    with _locked(target):
        if whole():  # made by the process this one waited for
            return target
        _remove_leftovers(target)
        partial = target.with_name(f".{target.name}.partial-{os.getpid()}-{os.urandom(4).hex()}")
        try:
            make(partial)
            _fsync_tree(partial)
            try:
                os.rename(partial, target)  # the commit point; the target is absent here (leftovers removed)
            except OSError as exc:
                raise CacheError(exc.errno, f"cannot commit the cache entry {target}: {exc}") from exc
            _fsync(target.parent)
        finally:
            _remove(partial)
    return target


@contextmanager
def _locked(target: Path) -> Iterator[None]:
    lock = target.with_name(f".{target.name}.lock")  # hidden, as the partials: listings show entries
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise CacheError(exc.errno, f"cannot open the cache lock {lock} ({_HINT}): {exc}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("event=cache_wait target=%s reason=another process is making it", target)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:  # a filesystem without flock (ENOLCK): say so rather than race
            raise CacheError(exc.errno, f"cannot lock {lock} ({_HINT}): {exc}") from exc
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_leftovers(target: Path) -> None:
    """Under the lock: partial entries of crashed makers, and a target that is not whole (nothing reads it:
    readers wait for the marker)."""
    for stale in target.parent.glob(f".{target.name}.partial-*"):
        log.warning("event=cache_stale_partial path=%s", stale)
        _remove(stale)
    if target.exists() or target.is_symlink():
        log.warning("event=cache_incomplete_entry path=%s action=remake", target)
        aside = target.with_name(f".{target.name}.partial-incomplete-{os.urandom(4).hex()}")
        try:
            os.rename(target, aside)
        except OSError as exc:
            raise CacheError(
                exc.errno, f"cannot move the incomplete cache entry {target} aside: {exc}"
            ) from exc
        _remove(aside)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_tree(path: Path) -> None:
    """Every file of a new entry on disk before its rename commits it (a crash then leaves it whole or absent)."""
    if path.is_dir():
        for folder, _, files in os.walk(path):
            for name in files:
                _fsync(Path(folder) / name)
            _fsync(Path(folder))
    else:
        _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["CacheError", "cache_root", "ensure_file", "ensure_folder"]
