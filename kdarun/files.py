"""Writing the user's files safely.

Every file or directory kdarun writes (a checkpoint, a stage dump, a run's output) is claimed
before the work that fills it: the target is checked (its directory exists, it may be
written, it exists only when `force` says to replace it, and it is none of the run's inputs)
and a temporary file or directory is created beside it, so a bad path is refused before any
computation. The temporary is renamed into place once it is whole, so an interrupted write
leaves the old target (or, for a directory being replaced, nothing in its place) and never a
mix of old and new files; the temporary is removed when the write fails.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from types import TracebackType
from typing import Callable, Mapping

from safetensors import SafetensorError

from .errors import KdaError

FORCE_HINT = "pass --force (force=True) to replace it"
WRITE_ERRORS = (OSError, SafetensorError)  # what a writer raises when the system refuses


def _claim(path: Path, what: str, make: Callable[[Path], None]) -> Path:
    """Create (with `make`) a temporary beside `path`, named after it and hidden; refuses a
    missing or unwritable directory."""
    parent = path.parent
    if not parent.exists():
        raise KdaError(f"{what} {path}: its directory {parent} does not exist")
    if not parent.is_dir():
        raise KdaError(f"{what} {path}: {parent} is not a directory")
    tmp = parent / f".{path.name}.{secrets.token_hex(4)}.partial"
    try:
        make(tmp)
    except OSError as e:
        raise KdaError(f"{what} {path}: cannot write in {parent} ({e.strerror})") from None
    return tmp


def _as_umask_allows(*files: Path) -> None:
    """Give written files the mode a plain `open` would (0666 less the umask): some writers
    (safetensors) create them readable by their owner alone."""
    mask = os.umask(0)
    os.umask(mask)
    for f in files:
        os.chmod(f, 0o666 & ~mask)


def _same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` name the same file, through symbolic links."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _inside(path: str, directory: Path) -> bool:
    """Whether `path` lies in `directory` (its own path, or through links)."""
    return any(Path(path).is_relative_to(d)
               for d in {directory, Path(os.path.realpath(directory))})


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class _Pending:
    """A claimed target and its temporary; leaving a `with` block by an exception (Ctrl-C
    included) removes the temporary. `commit(write)` has `write` fill the temporary, then
    puts it in the target's place (`_install`); a write the system refuses (a full disk) is
    a KdaError, and the target is left as it was. Without `force` a target that appeared
    while the temporary was written (another run's, or the user's) is not replaced either."""

    path: Path
    tmp: Path
    what: str
    force: bool

    def commit(self, write: Callable[[Path], None]) -> Path:
        try:
            write(self.tmp)
            self._install()
        except BaseException as e:
            self.discard()
            if isinstance(e, WRITE_ERRORS):
                raise KdaError(f"{self.what} {self.path}: cannot be written "
                               f"({getattr(e, 'strerror', None) or e})") from None
            raise
        return self.path

    def _appeared(self) -> KdaError:
        hint = "" if self.force else f" ({FORCE_HINT})"
        return KdaError(f"{self.what} {self.path} appeared while this run wrote it and was left "
                        f"as it is; nothing was written{hint}")

    def _install(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "_Pending":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is not None:
            self.discard()

    def discard(self) -> None:
        """Remove the temporary; the target is left as it was."""
        _remove(self.tmp)


class PendingFile(_Pending):
    """An output file: refused when it is a directory, exists without `force`, or is one of
    `protected` (a path -> what it is: the run's inputs, a checkpoint's files), which no
    `force` replaces."""

    def __init__(self, path: str | Path, *, force: bool, what: str = "output",
                 protected: Mapping[Path, str] | None = None):
        self.path = path = Path(os.path.abspath(path))
        for other, role in (protected or {}).items():
            if _same_file(path, Path(other)):
                raise KdaError(f"{what} {path} would overwrite {role} {other}; choose another "
                               "path (not even --force replaces it)")
        if path.is_dir():
            raise KdaError(f"{what} {path} is a directory, expected a file path")
        if (path.exists() or path.is_symlink()) and not force:
            raise KdaError(f"{what} {path} exists; {FORCE_HINT}")
        self.what, self.force = what, force
        self.tmp = _claim(path, what, lambda p: p.touch(exist_ok=False))

    def _install(self) -> None:
        """A rename with `force`; without it a hard link, which fails where the target exists
        (atomically), then the temporary's name goes (a rename after a last look where the
        file system has no hard links)."""
        _as_umask_allows(self.tmp)
        if self.force:
            os.replace(self.tmp, self.path)
            return
        try:
            os.link(self.tmp, self.path)
        except FileExistsError:
            raise self._appeared() from None
        except OSError:
            if os.path.lexists(self.path):
                raise self._appeared() from None
            os.replace(self.tmp, self.path)
            return
        self.tmp.unlink()


class PendingDir(_Pending):
    """An output directory, written whole into a temporary one: refused when it is a file,
    holds one of `protected` (a path -> what it is), or holds anything without `force`; with
    `force` it is replaced only when every entry is a file `owned` accepts by name (a
    directory of another kind, or with other files in it, is never replaced)."""

    def __init__(self, path: str | Path, *, force: bool, what: str,
                 owned: Callable[[str], bool], protected: Mapping[Path, str] | None = None):
        self.path = path = Path(os.path.abspath(path))
        for other, role in (protected or {}).items():
            if any(_inside(p, path) for p in (os.path.abspath(other), os.path.realpath(other))):
                raise KdaError(f"{what} {path} holds {role} {other}; choose another directory "
                               "(not even --force replaces it)")
        if path.is_symlink():
            raise KdaError(f"{what} {path} is a symbolic link (to {os.readlink(path)}); a "
                           f"{what} is written whole and renamed into place, which would "
                           "replace the link, not fill its target: give the directory itself")
        if path.exists() and not path.is_dir():
            raise KdaError(f"{what} {path} is a file, expected a directory")
        if path.is_dir() and _inside(os.getcwd(), path):
            raise KdaError(f"{what} {path} is (or holds) the current directory, which writing "
                           "it would replace; choose a directory below it")
        self.what, self.force, self.owned = what, force, owned
        self._check_held()
        self.tmp = _claim(path, what, lambda p: p.mkdir())

    def _check_held(self) -> list[str]:
        """What the target holds, once `force` and `owned` allow replacing it: nothing without
        `force`, else files `owned` accepts by name alone (checked when it is claimed and again
        before it is replaced)."""
        path, what = self.path, self.what
        held = sorted(os.listdir(path)) if path.is_dir() else []
        if held and not self.force:
            raise KdaError(f"{what} {path} exists and holds {_names(held)}; {FORCE_HINT}")
        foreign = [n for n in held if not (self.owned(n) and (path / n).is_file())]
        if foreign:
            raise KdaError(f"{what} {path} holds {_names(foreign)}, which a {what} does not "
                           "write; choose another directory (not even --force replaces it)")
        return held

    def _install(self) -> None:
        """A rename where the target is absent or empty (a rename over a directory that is not
        empty fails); else, as `force` allows, the old directory is moved aside first (back
        again if the rename fails) and removed after. What the target holds is looked at again
        first: it may have changed while the temporary was written."""
        _as_umask_allows(*(f for f in self.tmp.iterdir() if f.is_file()))
        if self.path.is_symlink() or (self.path.exists() and not self.path.is_dir()):
            raise self._appeared()
        if not self._check_held():
            os.rename(self.tmp, self.path)
            return
        old = self.path.parent / f".{self.path.name}.{secrets.token_hex(4)}.old"
        os.rename(self.path, old)
        try:
            os.rename(self.tmp, self.path)
        except BaseException:
            os.rename(old, self.path)
            raise
        _remove(old)


def _names(names: list[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
