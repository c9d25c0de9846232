"""Cut an (extended) XYZ byte stream into pieces of whole frames without parsing any frame.

A frame is an atom-count line, a comment line and one line per atom, so the next frame is found by counting
lines: the parent of a parallel build reads only the count lines and hands each piece's text to a worker that
parses it. Shared by the readers that build caches from xyz files in parallel.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO


@dataclass(frozen=True)
class XyzPiece:
    """Whole frames of a file: `start` is the index of the first frame in the file, `line` the 1-based line
    number of its count line, `frames` how many frames `text` (the raw bytes, line ends kept) holds."""

    start: int
    line: int
    frames: int
    text: bytes


class XyzCutError(ValueError):
    """A count line that is not a count, or a frame cut short by the end of the file: no later frame can be
    located. `index` is the frame's index in the file, `line` the 1-based line of its count line, `reason`
    `bad_count` or `truncated`, `text` the count line as read."""

    def __init__(self, index: int, line: int, reason: str, detail: str, text: bytes = b""):
        self.index, self.line, self.reason, self.detail, self.text = index, line, reason, detail, text
        super().__init__(f"frame {index} (line {line}): {detail}")

    def __reduce__(self):  # picklable across processes despite the custom __init__
        return (type(self), (self.index, self.line, self.reason, self.detail, self.text))


def cut_xyz_frames(f: IO[bytes], *, frames: int | None = None, piece_bytes: int | None = None,
                   blank: str = "skip", truncated: str = "error") -> Iterator[XyzPiece]:
    """`XyzPiece`s of the binary stream `f`, in order: a piece ends after `frames` frames, or once it holds at
    least `piece_bytes` bytes (whichever comes first; at least one frame each).

    `blank`: what a blank line where a count line is due means: "skip" (allowed between frames) or "end" (the end
    of the data, as ASE's reader treats it). `truncated`: "error" raises `XyzCutError` when the file ends inside a
    frame; "keep" hands the short frame on (its parser reports it). A bad count line raises `XyzCutError` after
    the piece of the frames before it has been yielded, so a caller meets the errors in file order.
    """
    if blank not in ("skip", "end") or truncated not in ("error", "keep"):
        raise ValueError(f"blank must be 'skip' or 'end' and truncated 'error' or 'keep', got {blank!r}, {truncated!r}")
    if frames is None and piece_bytes is None:
        raise ValueError("give frames or piece_bytes")
    max_frames = frames if frames is not None else 1 << 62
    max_bytes = piece_bytes if piece_bytes is not None else 1 << 62
    index = start = 0
    line_no = 0
    first_line = 1
    lines: list[bytes] = []
    size = 0

    def piece() -> XyzPiece:
        return XyzPiece(start, first_line, index - start, b"".join(lines))

    while line := f.readline():
        line_no += 1
        if not line.strip():
            if blank == "end":
                break
            continue
        try:
            n = int(line)
        except ValueError:
            n = None
        if n is None or n < 0:
            if lines:
                yield piece()
            text = line.decode("utf-8", "replace").strip()
            detail = (f"line {line_no}: expected an atom count, got {text[:60]!r}" if n is None
                      else f"line {line_no}: negative atom count {n}")
            raise XyzCutError(index, line_no, "bad_count", detail, line)
        if not lines:
            first_line = line_no
        frame = [line]
        for _ in range(n + 1):
            nxt = f.readline()
            if not nxt:
                if truncated == "error":
                    if lines:
                        yield piece()
                    raise XyzCutError(index, line_no, "truncated",
                                      f"truncated frame starting at line {line_no}: expected {n} atoms, file ends "
                                      f"after {max(len(frame) - 2, 0)}", line)
                break
            frame.append(nxt)
        line_no += len(frame) - 1
        lines.extend(frame)
        size += sum(len(x) for x in frame)
        index += 1
        if index - start >= max_frames or size >= max_bytes:
            yield piece()
            lines, start, size = [], index, 0
    if lines:
        yield piece()
