"""The xyz/SDF build in pieces: the parent cuts the file without parsing, workers parse, validate, perceive and
write one shard each, and the cache holds the rows of a serial read (order, ids, skips, property types, errors)
for any number of processes."""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("rdkit")

from trainer.data.xyz_pieces import XyzCutError, cut_xyz_frames  # noqa: E402
from trainer.families.molecules_edm import pieces, readers  # noqa: E402
from trainer.families.molecules_edm.dataset import build_molecule_dataset  # noqa: E402
from trainer.families.molecules_edm.readers import MoleculeDataError, bundled_qm9_path, read_molecules  # noqa: E402


@pytest.fixture
def one_record_pieces(monkeypatch):
    """Every piece a single record (the smallest piece: one byte), so any cross-piece rule is exercised."""
    monkeypatch.setattr(pieces, "MIN_PIECE_BYTES", 1)
    monkeypatch.setattr(pieces, "PIECE_TARGET", 1 << 30)


def _frame(symbols: str, info: str = "", shift: float = 0.0) -> str:
    atoms = "".join(f"{s} {1.1 * k + shift:.3f} 0.0 0.0\n" for k, s in enumerate(symbols.split()))
    return f"{len(symbols.split())}\n{info}\n{atoms}"


def _table(ds):
    return ds.with_format(None).data.table.combine_chunks()


def _serial(path: Path, tmp_path: Path, **kwargs):
    """Today's rows: the serial reader, written as one shard (the in-memory build)."""
    molecules, report = read_molecules(str(path), **{k: v for k, v in kwargs.items() if k != "compute_smiles"})
    ds = build_molecule_dataset(molecules, cache_dir=str(tmp_path / "serial"), compute_smiles=False,
                                elements=kwargs.get("elements", readers.QM9_ELEMENTS))
    return _table(ds), report


def test_cutter_finds_frames_by_their_count_lines_and_raises_after_the_earlier_pieces():
    frames = [_frame("C H", "a=1"), _frame("O", "a=2"), _frame("N H H H", "a=3")]
    text = (frames[0] + "\n" + frames[1] + frames[2] + "x\n").encode()  # a blank line between frames is allowed
    got = []
    with pytest.raises(XyzCutError) as e:
        for piece in cut_xyz_frames(io.BytesIO(text), frames=2):
            got.append(piece)
    assert [(p.start, p.frames, p.line) for p in got] == [(0, 2, 1), (2, 1, 9)]
    assert b"".join(p.text for p in got) == "".join(frames).encode()  # every frame's bytes, in order
    assert e.value.index == 3 and e.value.line == 15 and e.value.reason == "bad_count"
    with pytest.raises(XyzCutError, match="truncated frame starting at line 1: expected 3 atoms, file ends after 1"):
        list(cut_xyz_frames(io.BytesIO(b"3\n\nC 0 0 0\n"), frames=5))
    ended = list(cut_xyz_frames(io.BytesIO(_frame("C").encode() + b"\n" + _frame("O").encode()), frames=5, blank="end"))
    assert [p.frames for p in ended] == [1]


def test_bundled_pieces_equal_the_serial_rows_for_one_and_two_processes(tmp_path, monkeypatch):
    """Before: the parent parsed the whole file (and wrote one shard); now it cuts pieces, a worker parses each."""
    monkeypatch.setattr(pieces, "MIN_PIECE_BYTES", 1 << 18)
    path = bundled_qm9_path()
    serial, report = _serial(path, tmp_path)
    one = build_molecule_dataset(str(path), cache_dir=str(tmp_path / "p1"), compute_smiles=False, num_proc=1)
    assert len(list((tmp_path / "p1").rglob("*.arrow"))) > 2  # several pieces
    assert _table(one).equals(serial) and one.molecule_report == report

    def parent_must_not_parse(text):  # a spawned worker imports the real parser
        raise AssertionError("the parent parsed a frame")

    monkeypatch.setattr(readers, "_parse_xyz_frame", parent_must_not_parse)
    two = build_molecule_dataset(str(path), cache_dir=str(tmp_path / "p2"), compute_smiles=False, num_proc=2)
    assert _table(two).equals(serial) and two.molecule_report == report


def test_ids_skips_and_property_types_across_pieces_equal_a_serial_read(tmp_path, one_record_pieces):
    # record 2 repeats record 0's id (another piece); record 3 has an element outside the vocabulary; record 4's
    # own id repeats inside a later piece; `x` is an int, then a float, then a string (one column of strings);
    # `y` appears late; record 6 has no id (its default id carries its index in the file, not in the piece).
    frames = [_frame("C H", "id=a x=1"), _frame("O H H", "id=b x=2.5"), _frame("C", "id=a x=3"),
              _frame("C Cl", "id=c x=1"), _frame("N H H H", "id=d y=T"), _frame("C H", "id=d"),
              _frame("C O", "plain title"), _frame("F H", "id=e x=word")]
    path = tmp_path / "m.xyz"
    path.write_text("".join(frames))
    serial, report = _serial(path, tmp_path, on_invalid="skip")
    assert report.skipped == {"duplicate_id": 2, "unknown_element": 1}
    for num_proc in (1, 2):
        ds = build_molecule_dataset(str(path), cache_dir=str(tmp_path / f"n{num_proc}"), on_invalid="skip",
                                    compute_smiles=False, num_proc=num_proc)
        assert _table(ds).equals(serial), num_proc
        assert ds.molecule_report == report
    assert _table(ds).column("id").to_pylist() == ["a", "b", "d", "m#6", "e"]
    assert _table(ds).schema.field("x").type == "string"


def test_an_error_names_the_file_and_the_records_index_in_the_file_in_file_order(tmp_path, one_record_pieces):
    path = tmp_path / "m.xyz"
    path.write_text(_frame("C H", "id=a") + _frame("O", "id=b") + _frame("C", "id=a") + _frame("C Cl", "id=c"))
    with pytest.raises(MoleculeDataError) as serial:
        read_molecules(str(path))
    with pytest.raises(MoleculeDataError) as built:
        build_molecule_dataset(str(path), cache_dir=str(tmp_path / "c"), compute_smiles=False, num_proc=1)
    assert str(built.value) == str(serial.value)
    assert (built.value.source, built.value.index, built.value.record_id, built.value.reason) == (
        str(path), 2, "a", "duplicate_id")
    assert not list((tmp_path / "c").rglob("*.arrow"))  # a failed build leaves no shard

    path.write_text(_frame("C H", "id=a") + _frame("O", "id=b") + _frame("C Cl", "id=c") + "7\nbroken\n")
    with pytest.raises(MoleculeDataError) as built:
        build_molecule_dataset(str(path), cache_dir=str(tmp_path / "d"), compute_smiles=False, num_proc=2)
    assert (built.value.index, built.value.reason, built.value.detail) == (
        2, "unknown_element", "atom 1 is Cl, outside the element vocabulary (allowed: H C N O F)")
    path.write_text(_frame("C H", "id=a") + _frame("O", "id=b") + "seven\n")
    with pytest.raises(MoleculeDataError) as serial:
        read_molecules(str(path))
    with pytest.raises(MoleculeDataError) as built:
        build_molecule_dataset(str(path), cache_dir=str(tmp_path / "e"), compute_smiles=False, num_proc=1)
    assert str(built.value) == str(serial.value) and built.value.index == 2 and "line 8" in str(built.value)


def test_sdf_pieces_end_at_record_ends_and_equal_a_serial_read(tmp_path, one_record_pieces):
    from rdkit import Chem
    from rdkit.Chem import AllChem

    buf = io.StringIO()
    writer = Chem.SDWriter(buf)
    for k, smi in enumerate(["CCO", "C=O", "CCO", "CN"]):
        mol = Chem.AddHs(Chem.MolFromSmiles(smi))
        AllChem.EmbedMolecule(mol, randomSeed=k)
        mol.SetProp("_Name", f"m{k}")
        mol.SetProp("energy", str(-1.5 * k) if k != 3 else "n/a")
        writer.write(mol)
    writer.close()
    blocks = buf.getvalue().split("$$$$\n")
    # a block RDKit rejects (an atom line that is not one); the reader goes on at the next `$$$$`
    broken = blocks[1].split("\n")
    broken[5] = "not an atom line"
    text = blocks[0] + "$$$$\n" + "\n".join(broken) + "$$$$\n" + "$$$$\n".join(blocks[1:])
    path = tmp_path / "m.sdf"
    path.write_text(text)
    serial, report = _serial(path, tmp_path, on_invalid="skip")
    assert report.skipped == {"unparsable_record": 1}
    for num_proc in (1, 2):
        ds = build_molecule_dataset(str(path), cache_dir=str(tmp_path / f"s{num_proc}"), on_invalid="skip",
                                    compute_smiles=False, num_proc=num_proc)
        assert _table(ds).equals(serial) and ds.molecule_report == report
    assert _table(ds).column("id").to_pylist() == ["m#0", "m#2", "m#3", "m#4"]


def test_piece_size_follows_the_file_not_the_processes(tmp_path):
    path = bundled_qm9_path()
    size = pieces.piece_bytes_for(path)
    assert size == max(pieces.MIN_PIECE_BYTES, -(-pieces.text_size(path) // pieces.PIECE_TARGET))
    assert pieces.text_size(path) > path.stat().st_size  # the gzip's uncompressed size
    cut = list(pieces.cut_molecule_file(path))
    assert [p.start for p in cut] == sorted(p.start for p in cut) and cut[0].start == 0
    frames = Counter(p.text.count(b"Properties=") for p in cut)
    assert sum(k * v for k, v in frames.items()) == 3000
    assert np.all([len(p.text) < size + 10_000 for p in cut])


def test_a_piece_with_a_duplicate_of_an_earlier_piece_is_rebuilt_without_it(tmp_path, monkeypatch):
    from trainer.families.molecules_edm import dataset as dataset_module

    # two frames a piece: [a, b], [a (a duplicate of piece 0's), c], [d, c (a duplicate of piece 1's)]
    frames = [_frame("C H", f"id={i} x={k}") for k, i in enumerate("abacdc")]
    path = tmp_path / "m.xyz"
    path.write_text("".join(frames))
    monkeypatch.setattr(dataset_module, "piece_bytes_for", lambda p: len(frames[0]) + 1)
    assert [p.start for p in pieces.cut_molecule_file(path, len(frames[0]) + 1)] == [0, 2, 4]
    serial, report = _serial(path, tmp_path, on_invalid="skip")
    for num_proc in (1, 2):
        ds = build_molecule_dataset(str(path), cache_dir=str(tmp_path / f"n{num_proc}"), on_invalid="skip",
                                    compute_smiles=False, num_proc=num_proc)
        assert _table(ds).equals(serial) and ds.molecule_report == report
    assert _table(ds).column("id").to_pylist() == ["a", "b", "c", "d"]
    assert report.skipped == {"duplicate_id": 2}


def test_an_sdf_record_short_of_its_atoms_does_not_swallow_the_next(tmp_path, one_record_pieces):
    """A record that declares more atoms than it holds runs into its `$$$$`: RDKit's stream supplier then takes
    the next record with it. Each record is parsed on its own, so the next one is kept, numbered by its place in
    the file, the same in a serial read and in pieces."""
    from rdkit import Chem
    from rdkit.Chem import AllChem

    blocks = []
    for k, smi in enumerate(["CCO", "C=O", "CN", "CC"]):
        mol = Chem.AddHs(Chem.MolFromSmiles(smi))
        AllChem.EmbedMolecule(mol, randomSeed=k)
        mol.SetProp("_Name", f"m{k}")
        blocks.append(Chem.MolToMolBlock(mol) + "$$$$\n")
    lines = blocks[1].split("\n")
    atoms = int(lines[3][:3])
    # the counts line declares two atoms more than the block's atom lines, which run up to its `$$$$`
    blocks[1] = "\n".join(lines[:3] + [f"{atoms + 2:3d}" + lines[3][3:]] + lines[4:4 + atoms]) + "\n$$$$\n"
    path = tmp_path / "short.sdf"
    path.write_text("".join(blocks))
    serial, report = _serial(path, tmp_path, on_invalid="skip")
    assert report.skipped == {"unparsable_record": 1}
    assert serial.column("id").to_pylist() == ["short#0", "short#2", "short#3"]
    for num_proc in (1, 2):
        ds = build_molecule_dataset(str(path), cache_dir=str(tmp_path / f"s{num_proc}"), on_invalid="skip",
                                    compute_smiles=False, num_proc=num_proc)
        assert _table(ds).equals(serial) and ds.molecule_report == report


def test_a_file_build_checks_its_policy(tmp_path):
    with pytest.raises(ValueError, match="on_invalid must be 'error' or 'skip'"):
        build_molecule_dataset(str(bundled_qm9_path()), cache_dir=str(tmp_path), on_invalid="raise",
                               compute_smiles=False, num_proc=1)
