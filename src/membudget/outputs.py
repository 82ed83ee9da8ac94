"""Where membudget writes: never over an input, never half a file.

``check_output`` refuses an output before any long work starts. It refuses a path that is one of
the command's inputs, a directory, a device or an archive member, and it creates missing parent
folders. ``replacing`` writes to a temporary file beside the target and renames it into place
only once the file is complete, so a failed write (a full disk, Ctrl-C) leaves the old file,
or nothing, behind.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from membudget.errors import MembudgetError


def check_output(path: str | Path, inputs: Iterable[str | Path] = ()) -> Path:
    """``path`` as a :class:`Path` if a command may write it; else a clear error."""
    text = str(path)
    if "::" in text:
        raise MembudgetError(f"{text}: an output cannot be a member of an archive "
                             "(ARCHIVE::MEMBER); give a plain file to write")
    p = Path(path)
    if p.is_dir():
        raise MembudgetError(f"{p} is a directory; give a file name to write")
    if p.exists() and not p.is_file():
        raise MembudgetError(f"{p} is not a regular file; give a file name to write")
    for source in inputs:
        if _same_file(p, Path(str(source).split("::", 1)[0])):
            raise MembudgetError(f"{p} is also an input of this command, and writing it would "
                                 "destroy that input; give another output path")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MembudgetError(f"cannot create the folder {p.parent} for {p}: "
                             f"{e.strerror or e}") from None
    try:  # a file made and removed: the one test of writing that every file system passes
        tempfile.TemporaryFile(dir=p.parent).close()
    except OSError as e:
        raise MembudgetError(f"cannot write in {p.parent}: {e.strerror or e}") from None
    return p


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()
    except OSError:
        return False


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all."""
    with replacing(path) as tmp:
        tmp.write_text(text)
    return Path(path)


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write (keeping its last suffix: .gz, .png, ...);
    renamed to ``path`` when the block ends without an error, removed otherwise. A failed
    write becomes a :class:`MembudgetError` naming the file."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp{p.suffix}")
    try:
        yield tmp
        os.replace(tmp, p)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise MembudgetError(f"could not write {p}: {e.strerror or e}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
