"""Where membudget reads: every input file opened one way, within a size limit.

``open_text`` reads a plain file, a gzip file or a member of a zip archive (``A.zip::member``,
itself plain or gzip) as UTF-8 text. Bad bytes are kept as lone surrogates so a reader can
name the line they are on (``check_utf8``). Decompressed input beyond ``max_input_bytes()``
is refused, so a small archive cannot make a reader run for minutes. Errors quote fields
by ``membudget.errors.excerpt``, never whole.
"""

from __future__ import annotations

import gzip
import io
import os
import zipfile
import zlib
from pathlib import Path
from typing import IO

from membudget.errors import MembudgetError, TraceError, excerpt
from membudget.units import format_bytes, parse_bytes

ZIP_SEP = "::"
INT64_MAX = (1 << 63) - 1  # sizes and ids beyond it cannot be counted or replayed
MAX_INPUT_ENV = "MEMBUDGET_MAX_INPUT"
# 13x the largest trace the zoo records (ResNet-1202, 4.7 MB): room to spare, yet a bomb
# of blank lines is refused within seconds
DEFAULT_MAX_INPUT = 64 << 20
# what reading a truncated or corrupt file raises
CORRUPT = (EOFError, OSError, zlib.error, zipfile.BadZipFile)


def max_input_bytes() -> int:
    """The most text (after decompression) a reader takes: ``$MEMBUDGET_MAX_INPUT`` or
    64 MiB."""
    text = os.environ.get(MAX_INPUT_ENV)
    if not text:
        return DEFAULT_MAX_INPUT
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise MembudgetError(f"${MAX_INPUT_ENV}: {e}") from None


def split_source(path: str | Path) -> tuple[Path, str | None]:
    """Split ``archive.zip::member`` into the archive and the member (None for a plain file)."""
    text = str(path)
    if ZIP_SEP in text:
        archive, member = text.split(ZIP_SEP, 1)
        return Path(archive), member
    return Path(text), None


def _zip(archive: Path) -> zipfile.ZipFile:
    """The zip archive at ``archive``, or a clear error if it is none."""
    _check_file(archive)
    try:
        return zipfile.ZipFile(archive)
    except CORRUPT as e:
        raise TraceError(archive, None, f"not a zip archive, or a truncated one ({e})") from None


def zip_members(archive: str | Path, suffix: str = "") -> list[str]:
    """Names of the files in a zip archive that end with ``suffix``."""
    with _zip(Path(archive)) as z:
        return _files(z, suffix)


def _files(z: zipfile.ZipFile, suffix: str = "") -> list[str]:
    return [n for n in z.namelist() if not n.endswith("/") and n.endswith(suffix)]


def resolve_member(archive: Path, member: str, names: list[str] | None = None) -> str:
    """The archive member called ``member``, or the one file whose base name starts with it
    (among ``names``, the archive's files, when the caller has them)."""
    names = zip_members(archive) if names is None else names
    if member in names:
        return member
    hits = [n for n in names if n.rsplit("/", 1)[-1].startswith(member)]
    if len(hits) != 1:
        listed = ", ".join(n.rsplit("/", 1)[-1] for n in names)
        raise TraceError(archive, None, f"{'no' if not hits else 'several'} members match "
                                        f"{excerpt(member)}; members: "
                                        f"{excerpt(listed, 400) if names else 'none'}")
    return hits[0]


def _check_file(path: Path) -> None:
    if path.is_dir():
        raise TraceError(path, None, "is a directory, not a file to read")
    if not path.is_file():
        raise TraceError(path, None, "no such file")


class _Limited(io.RawIOBase):
    """A binary stream that refuses to give more than ``limit`` bytes (and closes what it
    was opened from)."""

    def __init__(self, raw: IO[bytes], limit: int, path: object,
                 owner: io.IOBase | zipfile.ZipFile | None = None) -> None:
        super().__init__()
        self.raw, self.limit, self.path, self.owner = raw, limit, path, owner
        self.total = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        n = self.raw.readinto(b)  # type: ignore[attr-defined]
        self.total += n
        if self.total > self.limit:
            raise TraceError(self.path, None, f"more than {format_bytes(self.limit)} of text "
                                              "(decompressed): larger than any trace or "
                                              "problem membudget expects; set "
                                              f"{MAX_INPUT_ENV} (e.g. {MAX_INPUT_ENV}=1GiB) "
                                              "to read it anyway")
        return n

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
            if self.owner is not None:
                self.owner.close()
        super().close()


def open_text(path: str | Path, encoding: str = "utf-8") -> IO[str]:
    """Open an input for reading as text: plain or gzip, or a member of a zip archive; bad
    bytes become lone surrogates (``check_utf8`` names their line)."""
    limit = max_input_bytes()
    archive, member = split_source(path)
    owner = None
    if member is not None:
        owner = _zip(archive)
        try:
            raw: IO[bytes] = owner.open(resolve_member(archive, member, _files(owner)))
        except (RuntimeError, NotImplementedError) as e:  # encrypted, unknown compression
            owner.close()
            raise TraceError(path, None, f"cannot read this archive member: {e}") from None
        except BaseException:
            owner.close()
            raise
    else:
        _check_file(archive)
        raw = open(archive, "rb")  # noqa: SIM115 (closed with the text stream)
    stream = io.BufferedReader(_Limited(raw, limit, path, owner), 1 << 16)
    if stream.peek(2)[:2] == b"\x1f\x8b":  # gzip: the limit is on what it inflates to
        inflated = gzip.GzipFile(fileobj=stream)
        stream = io.BufferedReader(_Limited(inflated, limit, path, stream), 1 << 16)
    return io.TextIOWrapper(stream, encoding=encoding, errors="surrogateescape")


def int64(value: object, signs: str = "+-") -> int | None:
    """``value`` as an integer within int64, if it is one: an int (not a bool) or a string of
    ASCII digits, after at most one leading sign from ``signs``; else None."""
    if type(value) is int:
        n = value
    elif isinstance(value, str):
        digits = value[1:] if value[:1] and value[0] in signs else value
        if not (digits.isascii() and digits.isdigit() and len(digits) <= 19):
            return None
        n = int(value)
    else:
        return None
    return n if abs(n) <= INT64_MAX else None


def check_utf8(raw: str, path: object, line: int) -> None:
    """A line read by ``open_text`` holds lone surrogates where its bytes were not UTF-8:
    name the line (an ASCII line, nearly every one, costs one check)."""
    if not raw.isascii():
        try:
            raw.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TraceError(path, line, f"not UTF-8 text (at character {e.start})") from None

