"""trainer/data/fetch.py: checksummed downloads into a cache, tested against local mirrors (these machines
are offline). The mirror files are the public mlearn Si files, rebuilt from the package's bundled copies, so
the registry's real checksums are what is checked."""

from __future__ import annotations

import gzip
import hashlib
import re
from pathlib import Path

import pytest

from trainer.data import fetch as F
from trainer.errors import DataError

SAMPLES = Path(F.__file__).resolve().parents[1] / "families" / "crystals" / "samples"


def public_bytes(name: str) -> bytes:
    """mlearn_si_training / mlearn_si_test as published (the bundled .json.gz decompress to them)."""
    split = name.removeprefix("mlearn_si_")
    return gzip.decompress((SAMPLES / f"mlearn_Si_{split}.json.gz").read_bytes())


def make_mirror(root: Path, files: dict[str, bytes]) -> Path:
    """A mirror in the cache's own layout: <root>/<NAME>/<file>."""
    for name, data in files.items():
        entry = F.REGISTRY[name]
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / entry.filename).write_bytes(data)
    return root


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv(F.CACHE_ENV, raising=False)
    monkeypatch.delenv(F.MIRROR_ENV, raising=False)


def test_registry_entries_are_complete_and_pinned():
    assert set(F.REGISTRY) == {"mlearn_si_training", "mlearn_si_test", "mlearn_mo_training", "mlearn_mo_test", "ani1x"}
    ani = F.REGISTRY["ani1x"]  # files of a pinned wheel (tests/families/molecules_edm/test_ani.py fetches it)
    assert ani.requirement == "torchani==2.2.4" and re.fullmatch(r"[0-9a-f]{64}", ani.sha256)
    assert len(ani.checksums()) == 2 + 8 * 4 * 9 and ani.license.startswith("MIT")
    for name, entry in ((n, e) for n, e in F.REGISTRY.items() if n != "ani1x"):
        assert entry.name == name and re.fullmatch(r"[0-9a-f]{64}", entry.sha256), name
        assert entry.url.startswith("https://raw.githubusercontent.com/materialsvirtuallab/mlearn/a04d3b6e")
        assert entry.license.startswith("BSD-3-Clause") and entry.description and entry.source and entry.size > 0
        assert entry.unpack == ""
    for name in ("mlearn_si_training", "mlearn_si_test"):  # the bundled copies are the registered files
        data = public_bytes(name)
        assert hashlib.sha256(data).hexdigest() == F.REGISTRY[name].sha256 and len(data) == F.REGISTRY[name].size


@pytest.mark.parametrize("as_url", [False, True])
def test_fetch_checks_the_checksum_and_then_uses_the_cache(tmp_path, monkeypatch, as_url):
    mirror = make_mirror(tmp_path / "mirror", {"mlearn_si_test": public_bytes("mlearn_si_test")})
    monkeypatch.setenv(F.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(F.MIRROR_ENV, mirror.as_uri() if as_url else str(mirror))
    path = F.fetch("mlearn_si_test")
    assert path == tmp_path / "cache" / "mlearn_si_test" / "test.json"
    assert F.sha256_of(path) == F.REGISTRY["mlearn_si_test"].sha256
    stamp = path.stat().st_mtime_ns
    (mirror / "mlearn_si_test" / "test.json").unlink()  # a second call must not need the source
    assert F.fetch("mlearn_si_test") == path and path.stat().st_mtime_ns == stamp
    assert F.is_cached(F.REGISTRY["mlearn_si_test"], tmp_path / "cache")
    assert [p.name for p in path.parent.iterdir() if p.name != ".lock"] == ["test.json"]  # no temporary files


def test_bad_checksum_is_one_line_naming_set_url_and_both_hashes(tmp_path):
    data = public_bytes("mlearn_si_test").replace(b"-297.62773938", b"-297.62773939", 1)  # one digit off
    mirror = make_mirror(tmp_path / "mirror", {"mlearn_si_test": data})
    with pytest.raises(DataError) as info:
        F.fetch("mlearn_si_test", cache=tmp_path / "cache", mirror=str(mirror))
    msg = str(info.value)
    url = (mirror / "mlearn_si_test" / "test.json").as_uri()
    assert "\n" not in msg and "'mlearn_si_test'" in msg and url in msg
    assert F.REGISTRY["mlearn_si_test"].sha256 in msg and hashlib.sha256(data).hexdigest() in msg
    assert not (tmp_path / "cache" / "mlearn_si_test" / "test.json").exists()  # nothing kept
    # a good copy afterwards is accepted
    make_mirror(mirror, {"mlearn_si_test": public_bytes("mlearn_si_test")})
    assert F.fetch("mlearn_si_test", cache=tmp_path / "cache", mirror=str(mirror)).is_file()


def test_unreachable_source_and_unknown_name(tmp_path):
    with pytest.raises(DataError) as info:
        F.fetch("mlearn_mo_test", cache=tmp_path / "cache", mirror=str(tmp_path / "empty"))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("data set 'mlearn_mo_test': cannot download")
    assert str(tmp_path / "cache" / "mlearn_mo_test" / "test.json") in msg and F.REGISTRY["mlearn_mo_test"].sha256 in msg
    with pytest.raises(DataError, match="unknown data set 'mlearn_si_tset'.*Did you mean: mlearn_si_test"):
        F.fetch("mlearn_si_tset", cache=tmp_path / "cache")


def test_gunzip_entry_gives_the_decompressed_file(tmp_path):
    gz = SAMPLES / "mlearn_Si_test.json.gz"
    entry = F.RemoteData("si_test_gz", gz.as_uri(), F.sha256_of(gz), gz.stat().st_size, "mlearn Si test, gzipped",
                         "BSD-3-Clause", "mlearn", unpack="gunzip")
    path = F.fetch("si_test_gz", cache=tmp_path / "cache", mirror="", registry={entry.name: entry})
    assert path == tmp_path / "cache" / "si_test_gz" / "mlearn_Si_test.json"
    assert F.sha256_of(path) == F.REGISTRY["mlearn_si_test"].sha256


def test_trainer_data_command(tmp_path, monkeypatch, capsys):
    from trainer.cli import main

    monkeypatch.setenv(F.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(F.MIRROR_ENV, str(make_mirror(tmp_path / "mirror",
                                                     {"mlearn_si_test": public_bytes("mlearn_si_test")})))
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert f"cache: {tmp_path / 'cache'}" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isalnum() and "cache:" not in line}
    rows.pop("name")
    assert set(rows) == set(F.REGISTRY) and rows["mlearn_si_test"][1:4] == ["309.8", "KB", "no"]
    assert rows["ani1x"][1:4] == ["10.5", "MB", "no"] and "pip download torchani==2.2.4" in out
    assert F.REGISTRY["mlearn_mo_training"].url in out and "BSD-3-Clause" in out
    assert main(["data", "fetch", "mlearn_si_test"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cache" / "mlearn_si_test" / "test.json")
    assert main(["data", "list"]) == 0
    assert "mlearn_si_test" in capsys.readouterr().out.split("yes")[0]
    assert main(["data", "fetch", "mlearn_si_test", "nope"]) == 2  # names checked before any download
    assert "trainer: error: unknown data set 'nope'" in capsys.readouterr().err
