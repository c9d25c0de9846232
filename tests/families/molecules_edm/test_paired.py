"""Paired comparison of two molecule sets (`evaluate-molecules versus=`): the statistics on hand-made numbers,
pairing by sample index or by order and its refusals, and one command run on two small files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from trainer.families.molecules_edm.paired import (
    Pairing,
    PairingError,
    compare_paired,
    pair_sets,
    paired_mean_difference,
    paired_proportion_difference,
    paired_ratio_difference,
    paired_uniqueness_difference,
)

# --------------------------------------------------------------------------------------------------
# the statistics


def test_mean_difference_on_hand_numbers():
    d = paired_mean_difference([1.0, 2.0, 3.0, 4.0], [0.0, 2.0, 1.0, 5.0])  # differences 1, 0, 2, -1
    se = math.sqrt(5 / 3) / 2  # sd of the differences (ddof 1) over sqrt(4)
    assert (d.n, d.difference, d.mean_a, d.mean_b) == (4, 0.5, 2.5, 2.0)
    assert d.se == pytest.approx(se)
    assert (d.low, d.high) == pytest.approx((0.5 - 3.182446305 * se, 0.5 + 3.182446305 * se))  # t(3) quantile
    assert (d.lower, d.higher, d.equal) == (1, 2, 1) and d.low < 0 < d.high  # noise: the interval covers 0
    shifted = paired_mean_difference([1.1, 2.0, 3.05, 4.1], [0.0, 1.0, 2.0, 3.0])  # every pair about 1 higher
    assert shifted.low > 0 and shifted.higher == 4
    one = paired_mean_difference([1.0], [0.5])
    assert one.difference == 0.5 and math.isnan(one.se) and math.isnan(one.low)
    with pytest.raises(ValueError, match="finite"):
        paired_mean_difference([1.0, float("nan")], [1.0, 2.0])


def test_proportion_difference_is_newcombes_paired_score_interval():
    # Reference tables (both, A only, B only, neither) with their published 95 % intervals.
    for counts, (low, high) in (((1, 1, 7, 12), (-0.5069, -0.0256)), ((59, 6, 16, 80), (-0.1186, -0.0046))):
        a = [True] * (counts[0] + counts[1]) + [False] * (counts[2] + counts[3])
        b = [True] * counts[0] + [False] * counts[1] + [True] * counts[2] + [False] * counts[3]
        r = paired_proportion_difference(a, b)
        assert r.difference == pytest.approx((counts[1] - counts[2]) / sum(counts))
        assert (r.low, r.high) == pytest.approx((low, high), abs=1e-4)
        assert (r.a_only, r.b_only) == counts[1:3]
        swapped = paired_proportion_difference(b, a)
        assert (swapped.low, swapped.high) == pytest.approx((-r.high, -r.low))
    balanced = paired_proportion_difference([True, False] * 20, [False, True] * 20)
    assert balanced.difference == 0 and balanced.low < 0 < balanced.high
    assert paired_proportion_difference([True] * 30, [False] * 30).low > 0.8


def test_ratio_difference_reduces_to_the_paired_mean_with_equal_denominators():
    stable_a, stable_b = np.array([4, 3, 4, 2, 4]), np.array([4, 2, 1, 2, 3])
    atoms = np.full(5, 4)
    r = paired_ratio_difference(stable_a, atoms, stable_b, atoms)
    m = paired_mean_difference(stable_a / 4, stable_b / 4)
    assert (r.a, r.b) == pytest.approx((17 / 20, 12 / 20))
    assert (r.difference, r.se, r.low, r.high) == pytest.approx((m.difference, m.se, m.low, m.high))
    pooled = paired_ratio_difference([1, 9], [2, 10], [0, 9], [2, 10])  # pooled over atoms, not per molecule
    assert pooled.difference == pytest.approx(10 / 12 - 9 / 12)
    assert paired_ratio_difference([1, 9], [2, 10], [1, 9], [2, 10]).se == 0.0


def test_uniqueness_jackknife_matches_leaving_each_pair_out():
    a = ["C", "C", "CC", None, "CO", "N"]
    b = ["C", "CO", "CC", "N", "CO", None]
    r = paired_uniqueness_difference(a, b)

    def uniqueness(smiles):
        valid = [s for s in smiles if s is not None]
        return len(set(valid)) / len(valid) if valid else 0.0

    assert (r.a, r.b, r.difference) == pytest.approx((4 / 5, 4 / 5, 0.0))
    rest = np.array([uniqueness(a[:k] + a[k + 1:]) - uniqueness(b[:k] + b[k + 1:]) for k in range(len(a))])
    n = len(a)
    assert r.se == pytest.approx(math.sqrt((n - 1) / n * ((rest - rest.mean()) ** 2).sum()))
    assert r.low < 0 < r.high and "jackknife" in r.interval


# --------------------------------------------------------------------------------------------------
# pairing


def infos(indices):
    return [{"id": f"set#{k}", **({} if i is None else {"sample_index": i})} for k, i in enumerate(indices)]


def test_pairing_by_sample_index_counts_the_unmatched():
    p = pair_sets(infos([0, 1, 2, 3]), infos([3, 1, 0]), [5, 6, 7, 8], [8, 6, 5], "A.extxyz", "B.extxyz")
    assert p.by == "sample_index" and p.pairs == [(0, 2), (1, 1), (3, 0)] and (p.only_a, p.only_b) == (1, 0)
    by_order = pair_sets(infos([None] * 3), infos([None] * 3), [5, 6, 7], [5, 6, 7], "A", "B")
    assert by_order.by == "order" and by_order.pairs == [(0, 0), (1, 1), (2, 2)]
    one_side = pair_sets(infos([0, 1]), infos([None, None]), [5, 6], [5, 6], "A", "B")
    assert one_side.by == "order" and "only A has sample_index" in one_side.note


@pytest.mark.parametrize("a, b, atoms_b, skipped, message", [
    ([0, 1, 1], [0, 1, 2], [5, 6, 7], 0, r"A\.extxyz versus B\.extxyz: cannot pair: A\.extxyz has sample_index 1 "
                                          r"twice \(records 1 and 2\)"),
    ([0, 1], [2, 3], [5, 6], 0, "no sample_index is in both files"),
    ([None] * 3, [None] * 2, [5, 6], 0, "3 and 2 molecules, and the files do not both carry sample_index"),
    ([None] * 3, [None] * 3, [5, 6, 7], 1, r"records were skipped \(0 of A\.extxyz, 1 of B\.extxyz\)"),
    ([1, 0, 2], [None] * 3, [5, 6, 7], 0, "only A.extxyz has sample_index, and its indices are not 0, 1, 2"),
    ([0, None, 2], [0, 1, 2], [5, 6, 7], 0, r"A\.extxyz: record 1 \(id 'set#1'\): no sample_index field"),
    ([0, 1, 2], [0, 1, 2], [5, 9, 7], 0, r"sample_index 1 has 6 atoms in A\.extxyz \(record 1\) and 9 in B\.extxyz"),
])
def test_pairing_refusals_name_both_files(a, b, atoms_b, skipped, message):
    with pytest.raises(PairingError, match=message):
        pair_sets(infos(a), infos(b), [5, 6, 7][:len(a)], atoms_b, "A.extxyz", "B.extxyz", skipped_b=skipped)


def test_a_sample_index_that_is_not_a_whole_number_names_record_and_field():
    bad = infos([0, 1])
    bad[1]["sample_index"] = "one"
    with pytest.raises(PairingError, match=r"B\.extxyz: record 1 \(id 'set#1'\): field sample_index is 'one'"):
        pair_sets(infos([0, 1]), bad, [5, 6], [5, 6], "A.extxyz", "B.extxyz")


def test_force_pairs_not_scored_on_both_sides_are_counted_by_reason():
    def row(ok, rms=1.0, unsupported=False):
        return {"valid": True, "smiles": "C", "stable": True, "num_stable_atoms": 5, "num_atoms": 5,
                "forcefield_ok": ok, "force_rms": rms if ok else float("nan"), "energy_per_atom": -1.0 if ok else
                float("nan"), "forcefield_unsupported": unsupported}

    rows_a = [row(True, 1.0), row(True, 2.0), row(False), row(True, 3.0), row(False), row(False, unsupported=True)]
    rows_b = [row(True, 1.5), row(True, 1.0), row(True), row(False), row(False), row(True)]
    c = compare_paired(rows_a, rows_b, Pairing([(k, k) for k in range(6)], "order"))
    assert c.forces["force_rms"].n == 2 and c.forces["force_rms"].difference == pytest.approx(0.25)
    assert c.forces_left_out["force_rms"] == {"A failed": 1, "B failed": 1, "A failed, B failed": 1,
                                              "A unsupported": 1}
    assert c.rates["validity"].difference == 0 and json.dumps(c.as_dict())


# --------------------------------------------------------------------------------------------------
# the command


def test_evaluate_command_versus_prints_and_writes_the_comparison(tmp_path, capsys):
    pytest.importorskip("rdkit")
    from test_molecule_metrics import ethylene, tetrahedral, water

    from trainer.families.molecules_edm.evaluate import main, write_molecules_extxyz
    from trainer.families.molecules_edm.molecule import Molecule

    clash = Molecule([6, 1, 1, 1, 1], np.vstack([np.zeros(3), 0.3 * np.eye(3), [[0, 0, 0.35]]]))
    a = [tetrahedral("C", 1.09), water(), ethylene(), tetrahedral("C", 1.09), water()]
    b = [tetrahedral("C", 1.3), water(1.2), ethylene(), clash, water()]
    for k, (ma, mb) in enumerate(zip(a, b)):
        ma.info["sample_index"] = mb.info["sample_index"] = k
    path_a = write_molecules_extxyz(a, tmp_path / "a.extxyz")
    path_b = write_molecules_extxyz(b[::-1], tmp_path / "b.extxyz")  # paired by index, not by order
    out = tmp_path / "m.json"
    assert main([str(path_a), f"versus={path_b}", "forcefield=springs", f"out={out}"]) == 0
    printed = capsys.readouterr().out
    assert f"A = {path_a}, B = {path_b}: 5 pairs by sample_index" in printed
    # the stretched water is unstable too: 3 of 5 pairs lose stability, beyond the noise of 5 pairs
    assert "molecule_stability   A 100.00  B  40.00  A - B +60.00  [+2.98, +88.24]  Newcombe's paired score " \
           "interval; A only 3, B only 0" in printed
    assert "validity             A 100.00  B  80.00  A - B +20.00  [-26.43, +62.45]" in printed
    assert "force field springs: A - B over the pairs it scored on both sides" in printed
    assert "n 5: A lower in " in printed and "none left out" in printed
    written = json.loads(out.read_text())
    versus = written["versus"]
    assert written["file"] == str(path_a) and versus["file"] == str(path_b) and versus["summary"]["num_molecules"] == 5
    assert versus["pairs"] == 5 and versus["paired_by"] == "sample_index"
    assert versus["rates"]["molecule_stability"]["difference"] == pytest.approx(0.6)
    assert versus["forces"]["force_rms"]["n"] == 5 and versus["forces_left_out"]["force_rms"] == {}
    # by order, different counts cannot be paired: one line naming both files
    plain = write_molecules_extxyz([Molecule(m.numbers, m.positions) for m in a[:4]], tmp_path / "c.extxyz")
    bare = write_molecules_extxyz([Molecule(m.numbers, m.positions) for m in a], tmp_path / "d.extxyz")
    with pytest.raises(PairingError, match=f"{plain} versus {bare}: cannot pair: 4 and 5 molecules"):
        main([str(plain), f"versus={bare}", "forcefield=none"])
