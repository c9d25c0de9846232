"""Data sets too big to bundle, fetched on demand with checksums into a cache (`pooch`).

`REGISTRY` maps a name to where the file comes from (a URL pinned to a commit where the host allows
it), its sha256, what it is, its license and how to unpack it. `fetch(NAME)` returns the local path,
downloading once into `$TRAINER_DATA_CACHE` (default: `pooch.os_cache("sciml-trainer")`, e.g.
`~/.cache/sciml-trainer`) as `<cache>/<NAME>/<file>`; a cached file whose checksum still matches is
used without any network access. A download whose sha256 differs from the registry's is deleted and
is a one-line `DataError` naming the data set, the URL and both hashes.

Where the machines cannot reach the public source, `$TRAINER_DATA_MIRROR` (a folder, `file://` URL or
`http(s)://` URL) replaces it: the file is read from `<mirror>/<NAME>/<file>`, the cache's own layout,
so another machine's cache folder is a valid mirror. The checksum is checked all the same.

Configs refer to a data set as `${fetch:NAME}` (an OmegaConf resolver registered by
`trainer.config`), e.g. `task.data_path: ${fetch:mlearn_mo_training}`; the command line has
`trainer data list` and `trainer data fetch NAME ...` (entry point `trainer.commands`: data).

Parameter sets published only inside a Python package (ANI-1x, in the torchani 2.2.4 wheel) are
`PackageFiles` entries: pip downloads the pinned wheel, and only the listed members are extracted and checked
file by file (`package_files.py`). `locate(NAME)` returns an already fetched set without downloading.

Only sets whose checksum could be taken from a copy of the published file are listed; see `REGISTRY`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from trainer.data.package_files import PackageFiles, fetch_package_files, locate_package_files, sha256_of
from trainer.errors import DataError

CACHE_ENV = "TRAINER_DATA_CACHE"
"""Environment variable: the cache folder (default `pooch.os_cache("sciml-trainer")`)."""
MIRROR_ENV = "TRAINER_DATA_MIRROR"
"""Environment variable: a folder or URL laid out as `<mirror>/<NAME>/<file>` that replaces the public URLs."""
APP_NAME = "sciml-trainer"


@dataclass(frozen=True)
class RemoteData:
    """One file of a public data set: where it is, its checksum, what it is and how to use it."""

    name: str
    url: str
    sha256: str
    size: int
    """Bytes of the downloaded file (for `trainer data list`; the checksum is what is checked)."""
    description: str
    license: str
    source: str
    """Where it comes from (project, paper), for citation."""
    unpack: str = ""
    """`""` (use the file as is), `gunzip` (a .gz file -> the decompressed file), `unzip` / `untar` (an archive
    -> the folder it is extracted to)."""

    @property
    def filename(self) -> str:
        return unquote(Path(urlparse(self.url).path).name)


# mlearn (materialsvirtuallab/mlearn, BSD-3-Clause): the URLs are pinned to commit a04d3b6e, the version of
# data/ these checksums belong to (data/Mo/test.json differs at another commit of the repository, so a URL on
# `master` could change under the checksum). The sha256 values were computed from the team's copies of these
# files; those copies match the upstream files at that commit in size and in their first and last 16,000
# characters (compared through a code index), but the upstream bytes were not hashed directly here (these
# machines are offline). The bundled trainer/families/crystals/samples/mlearn_Si_*.json.gz decompress to
# exactly the Si files below (tests/data/test_fetch.py checks it).
_MLEARN = "https://raw.githubusercontent.com/materialsvirtuallab/mlearn/a04d3b6ecaac47c27aa8f7e452c16a5c9a2a8cff/data"
_MLEARN_LICENSE = "BSD-3-Clause (materialsvirtuallab/mlearn)"
_MLEARN_SOURCE = ("mlearn, Zuo et al., 'Performance and Cost Assessment of Machine Learning Interatomic Potentials', "
                  "J. Phys. Chem. A 124, 731 (2020)")
_MLEARN_WHAT = ("mlearn {el} {split} set: {n} DFT (PBE) structures (ground state, strained, vacancy, surface, AIMD), "
                "total energy (eV), forces (eV/Å), virial stress (kbar); JSON, pymatgen Structure.as_dict() records")

_MLEARN_FILES = (  # element, split, structures, sha256, bytes
    ("Si", "training", 214, "ae6d4b0a65b00e0fcf7ba0a6fad366716710d2f0d21d70199203089c6866b500", 2_669_946),
    ("Si", "test", 25, "d452b30a89f23bff76f7cc529b7b6c2d159ea81ccd5a4599fb1a18207654fa91", 309_803),
    ("Mo", "training", 194, "b13305fca0d0d2631ab080c8fcf13c743ee79a911712fb65a34ca88fadf09f9a", 2_127_325),
    ("Mo", "test", 23, "68169e2927c2115daa2f504805fcb9548ee65daf2dd015428807ba92f8e13bb8", 250_629),
)

# ANI-1x (Smith et al., J. Chem. Phys. 148, 241733 (2018)): the NeuroChem parameters of the 8-network ensemble
# ship inside the torchani 2.2.4 wheel (MIT); torchani 2.9 reads them but would download them from a hub. The
# info file is empty in that wheel: its four lines (constants, self energies, ensemble prefix, size) are written.
ANI1X = PackageFiles(
    name="ani1x", requirement="torchani==2.2.4", wheel="torchani-2.2.4-py3-none-any.whl",
    sha256="de99afb38aeee9bf8553e58c468539ed41baf6b217833c2fc90429ad4261a02d", size=10_539_398,
    prefix="torchani/resources/", dest="Neurochem",
    description="ANI-1x ensemble (8 networks; H C N O; wB97x/6-31G(d)): AEV constants, self energies, network "
                "weights, extracted from the torchani 2.2.4 wheel (the `ani1x` force field)",
    license="MIT (aiqm/torchani)",
    source="Smith et al., 'Less is more: sampling chemical space with active learning', J. Chem. Phys. 148, 241733 (2018)",
    generated=(("ani-1x_8x.info", "ani-1x_8x/rHCNO-5.2R_16-3.5A_a4-8.params\nani-1x_8x/sae_linfit.dat\n"
                                  "ani-1x_8x/train\n8\n"),),
)

REGISTRY: dict[str, RemoteData | PackageFiles] = {d.name: d for d in (
    *(RemoteData(f"mlearn_{el.lower()}_{split}", f"{_MLEARN}/{el}/{split}.json", sha256, size,
                 _MLEARN_WHAT.format(el=el, split=split, n=n), _MLEARN_LICENSE, _MLEARN_SOURCE)
      for el, split, n, sha256, size in _MLEARN_FILES),
    ANI1X,
)}
"""The fetchable data sets. Not listed (no copy to take a checksum from on the machines this was written on;
add an entry with the sha256 of a verified download): full QM9, UniRef50, the GEARS Norman set, full JARVIS-DFT."""


def cache_dir() -> Path:
    """`$TRAINER_DATA_CACHE`, else pooch's per-user cache folder for this package."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    import pooch

    return Path(pooch.os_cache(APP_NAME))


def lookup(name: str, registry: dict[str, RemoteData | PackageFiles] | None = None) -> RemoteData | PackageFiles:
    registry = REGISTRY if registry is None else registry
    if name in registry:
        return registry[name]
    close = difflib.get_close_matches(name, list(registry), n=3)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise DataError(f"unknown data set {name!r}; `trainer data list` shows the {len(registry)} known ones "
                    f"({', '.join(sorted(registry))}).{hint}")


def source_url(entry: RemoteData, mirror: str | None = None) -> str:
    """The URL the file is read from: `<mirror>/<NAME>/<file>` when a mirror is set, else the public URL."""
    mirror = os.environ.get(MIRROR_ENV) if mirror is None else mirror
    if not mirror:
        return entry.url
    if "://" not in mirror:  # a plain folder
        mirror = Path(mirror).expanduser().resolve().as_uri()
    return f"{mirror.rstrip('/')}/{entry.name}/{entry.filename}"


def local_path(entry: RemoteData, cache: Path | None = None) -> Path:
    """Where `fetch` keeps the file (before unpacking)."""
    return (cache or cache_dir()) / entry.name / entry.filename


def is_cached(entry: RemoteData | PackageFiles, cache: Path | None = None) -> bool:
    """True when the cached file exists (its checksum is checked by `fetch`, not here)."""
    if isinstance(entry, PackageFiles):
        return (cache or cache_dir()).joinpath(entry.name, entry.dest).is_dir()
    return local_path(entry, cache).is_file()


def locate(name: str, cache: str | Path | None = None) -> Path:
    """The local path of an already fetched data set, never downloading: a package-files set (ANI-1x) is
    checked file by file; a missing one is a one-line DataError naming `trainer data fetch NAME`."""
    entry = lookup(name)
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    if isinstance(entry, PackageFiles):
        return locate_package_files(entry, root)
    path = local_path(entry, root)
    if not path.is_file():
        raise DataError(f"data set {name!r} is not in the cache ({path}); run `trainer data fetch {name}`")
    return path


class _HashingDownloader:
    """Runs pooch's downloader for the URL's scheme (or copies a file:// URL) and records the sha256 of
    what arrived, so a mismatch can name both hashes whatever pooch's message says."""

    def __init__(self, progressbar: bool):
        self.progressbar, self.sha256 = progressbar, ""

    def __call__(self, url: str, output_file: str, pooch_obj: object = None) -> None:
        if urlparse(url).scheme == "file":
            source = Path(unquote(urlparse(url).path))
            if not source.is_file():
                raise FileNotFoundError(f"no file {source}")
            shutil.copyfile(source, output_file)
        else:
            from pooch.downloaders import choose_downloader

            choose_downloader(url, progressbar=self.progressbar)(url, output_file, pooch_obj)
        self.sha256 = sha256_of(output_file)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One download per data set at a time (the ranks of a launch resolve the same config together)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: pooch's temporary file + move keeps each download whole anyway
        yield
        return
    with open(folder / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _processor(entry: RemoteData) -> object | None:
    """The pooch processor that unpacks the download (None: the file is used as is)."""
    import pooch

    if entry.unpack == "":
        return None
    if entry.unpack == "gunzip":
        return pooch.Decompress(method="gzip", name=entry.filename.removesuffix(".gz"))
    if entry.unpack == "unzip":
        return pooch.Unzip(extract_dir=entry.filename + ".unzip")
    if entry.unpack == "untar":
        return pooch.Untar(extract_dir=entry.filename + ".untar")
    raise DataError(f"data set {entry.name!r}: unknown unpack method {entry.unpack!r} (gunzip, unzip, untar)")


def fetch(name: str, *, cache: str | Path | None = None, mirror: str | None = None,
          registry: dict[str, RemoteData | PackageFiles] | None = None, progressbar: bool | None = None) -> Path:
    """The local path of data set NAME, downloaded (and checked against its sha256) on first use.

    `cache` and `mirror` default to $TRAINER_DATA_CACHE / $TRAINER_DATA_MIRROR (see the module docstring).
    An archive (`unpack`) gives the folder it was extracted to, a gzip file the decompressed file.
    """
    import pooch

    entry = lookup(name, registry)
    if isinstance(entry, PackageFiles):
        root = Path(cache).expanduser() if cache is not None else cache_dir()
        with _locked(root / entry.name):
            return fetch_package_files(entry, root, mirror)
    folder = (Path(cache).expanduser() if cache is not None else cache_dir()) / entry.name
    url = source_url(entry, mirror)
    downloader = _HashingDownloader(sys.stderr.isatty() if progressbar is None else progressbar)
    processor = _processor(entry)
    try:
        with _locked(folder):
            result = pooch.retrieve(url, known_hash=f"sha256:{entry.sha256}", fname=entry.filename, path=folder,
                                    processor=processor, downloader=downloader)
    except ValueError as err:
        if not downloader.sha256 or downloader.sha256 == entry.sha256:
            raise DataError(f"data set {entry.name!r} from {url}: {' '.join(str(err).split())}") from None
        raise DataError(f"data set {entry.name!r}: checksum mismatch for {url}: expected sha256 {entry.sha256}, "
                        f"got {downloader.sha256} (download deleted; a corrupted transfer, or the source changed)"
                        ) from None
    except Exception as err:  # network (requests), a missing mirror file, a full disk: one line, what to do
        detail = _short_reason(err)
        raise DataError(f"data set {entry.name!r}: cannot download {url} ({detail}); without "
                        f"network access put the file at {folder / entry.filename} (sha256 {entry.sha256}) or set "
                        f"{MIRROR_ENV} to a folder holding {entry.name}/{entry.filename}") from None
    if isinstance(result, list):  # an unpacked archive: its folder
        suffix = ".unzip" if entry.unpack == "unzip" else ".untar"
        return folder / (entry.filename + suffix)
    return Path(result)


def _short_reason(err: Exception) -> str:
    """`ConnectionError: cannot connect to raw.githubusercontent.com` rather than urllib3's page of text."""
    kind = type(err).__name__
    if kind == "ConnectionError" and type(err).__module__.startswith("requests"):
        host = urlparse(getattr(getattr(err, "request", None), "url", "") or "").hostname
        return f"{kind}: cannot connect" + (f" to {host}" if host else "")
    text = " ".join(str(err).split())
    return f"{kind}: {text[:200]}{'...' if len(text) > 200 else ''}"


def resolve_fetch(name: str) -> str:
    """The `${fetch:NAME}` config resolver: the local path of NAME as a string."""
    return str(fetch(name))


# --------------------------------------------------------------------------------------------------
# `trainer data`


def human_size(size: float) -> str:
    """Bytes in B, KB, MB or GB (powers of 1000), one decimal from KB up."""
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size} B"


def list_text(cache: Path | None = None, registry: dict[str, RemoteData | PackageFiles] | None = None) -> str:
    registry = REGISTRY if registry is None else registry
    cache = cache or cache_dir()
    rows = [f"cache: {cache} (${CACHE_ENV})" + (f"; mirror: {os.environ[MIRROR_ENV]}" if os.environ.get(MIRROR_ENV)
                                                 else ""),
            "", f"{'name':<22} {'size':>9}  {'cached':<6}  license / what it is"]
    for name in sorted(registry):
        entry = registry[name]
        cached = "yes" if is_cached(entry, cache) else "no"
        rows.append(f"{name:<22} {human_size(entry.size):>9}  {cached:<6}  {entry.license}")
        rows.append(f"{'':<42}{entry.description}")
        rows.append(f"{'':<42}{entry.url}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """`trainer data list` | `trainer data fetch NAME [NAME ...]` (prints each local path) |
    `trainer data prepare CONFIG [key=value ...]` (builds a config's data caches ahead of a job: prepare.py)."""
    from trainer.data import prepare

    parser = argparse.ArgumentParser(prog="trainer data", description="Public data sets too big to bundle: list "
                                     "them, or download them with checksums into the cache; or build a config's "
                                     "data caches ahead of a job (prepare).")
    parser.add_argument("--cache", default=None, help=f"cache folder (default ${CACHE_ENV}, else {APP_NAME}'s user "
                        "cache folder)")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="the known data sets, their size, license and whether they are cached")
    get = sub.add_parser("fetch", help="download (once) and print the local path of each NAME")
    get.add_argument("names", nargs="+", metavar="NAME")
    prepare.add_arguments(sub.add_parser(
        "prepare", help="build the data caches of CONFIG (+ overrides, as `trainer train` takes them) in this "
                        "process, under the lock a run takes, so that the job finds them built"))
    args = parser.parse_args(argv)
    if args.action == "prepare":
        return prepare.run(args.config, args.overrides)
    cache = Path(args.cache).expanduser() if args.cache else None
    if args.action == "list":
        print(list_text(cache))
        return 0
    for name in args.names:
        lookup(name)  # all names checked before the first download
    for name in args.names:
        print(fetch(name, cache=cache))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
