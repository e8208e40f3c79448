"""The figures and claims of `docs/results.md` and the README hold on the records they cite
(`benchmarks/claims.py --check`), every cited record is checked, and each kind of drift fails: a figure edited on
the page, a number added without a record, a record cited without a check, a record that no longer supports a
claim, and a claim over runs whose list is empty. Reading JSON only: cheap."""

import copy
import json
from pathlib import Path

import pytest

from benchmarks.claims import (CLAIMS, RECORDS, check, check_figures, check_record, coverage, holds, main,
                               numbers)
from benchmarks.figures import FIGURES, PAGES

ROOT = Path(__file__).resolve().parents[1]


def pages() -> dict[str, str]:
    return {p: (ROOT / p).read_text(encoding="utf-8") for p in PAGES}


def failures(lines: list[str]) -> list[str]:
    return [line for line in lines if not line.startswith("ok")]


def test_every_published_figure_and_claim_holds_on_its_record():
    lines = check() + check_figures()
    assert len(lines) >= len(CLAIMS) + len(FIGURES)
    assert not failures(lines)


def test_every_cited_record_is_checked():
    table = coverage()
    assert len(table) >= 40
    assert not [rec for rec, what in table.items() if not what]
    assert main(["--coverage"]) == 0


def test_a_figure_edited_on_the_page_fails():
    """0.983x -> 0.993x in the whole-step table: the figure no longer stands on the page, and the new number belongs
    to no figure; both are reported."""
    text = pages()
    row = next(line for line in text["docs/results.md"].splitlines() if line.startswith("| main job with the gate, 50"))
    assert "0.983x pooled" in row
    text["docs/results.md"] = text["docs/results.md"].replace(row, row.replace("0.983x pooled", "0.993x pooled"))
    bad = failures(check_figures(text))
    assert any(line.startswith("FAIL figure docs/results.md: '0.983x pooled") for line in bad)
    assert any("unchecked number on docs/results.md: '0.993'" in line for line in bad)


def test_a_number_off_by_one_printed_digit_fails(tmp_path):
    """The printed figure must equal the record at its precision: the record's pooled gen-stage ratio moved by one
    unit of the third decimal fails the figure (and only figures of that quantity)."""
    src = ROOT / "research/records/main_job_same_rollouts.json"
    record = json.loads(src.read_text())
    record["claims"]["gen_speedup"]["pooled"] += 0.001
    root = tmp_path
    for fig in FIGURES:
        if fig.source.startswith("research/"):
            (root / fig.source).parent.mkdir(parents=True, exist_ok=True)
            (root / fig.source).write_bytes((ROOT / fig.source).read_bytes())
    (root / "research/records/main_job_same_rollouts.json").write_text(json.dumps(record))
    bad = failures(check_figures(pages(), root))
    assert bad and all("main_job_same_rollouts.json" in line and "0.983" in line for line in bad)


def test_a_cited_record_without_a_check_fails():
    text = pages()
    text["docs/results.md"] += "\n| new claim | 1x | CPU | abc | [new.json](../research/records/new.json) |\n"
    assert coverage(text)["research/records/new.json"] == []


def test_a_record_that_no_longer_supports_a_claim_fails_it(tmp_path):
    """The H200 record with the gen stage at 1.2x (below the 1.3x the page claims) fails that claim and no other;
    with the field gone, the claim fails and names what is missing."""
    record = json.loads((ROOT / RECORDS["gpu_h200"][0]).read_text())
    record["main_job"]["gen_speedup"] = 1.2
    lines = check_record("gpu_h200", record)
    assert [line.split(": ")[1] for line in lines if line.startswith("FAIL")] == ["gen stage on one H200 meets 1.3x"]
    del record["main_job"]["gen_speedup"]
    assert "record lacks it (KeyError" in check_record("gpu_h200", record)[0]
    fresh = tmp_path / "h200.json"
    record["main_job"]["gen_speedup"] = 1.2
    fresh.write_text(json.dumps(record))
    assert main(["--check", f"gpu_h200={fresh}"]) == 1
    assert main(["--check", f"gpu_h200={ROOT / RECORDS['gpu_h200'][0]}"]) == 0


class Tracked(dict):
    """A record that notes the path of every list a reader takes from it."""

    def __init__(self, data, path=(), seen=None):
        super().__init__(data)
        self.path, self.seen = path, seen if seen is not None else set()

    def __getitem__(self, key):
        return wrap(super().__getitem__(key), self.path + (key,), self.seen)


def wrap(value, path, seen):
    if isinstance(value, dict):
        return Tracked(value, path, seen)
    if isinstance(value, list):
        seen.add(path)
        return [wrap(v, path + (i,), seen) for i, v in enumerate(value)]
    return value


def emptied(record: dict, path: tuple) -> dict:
    out = copy.deepcopy(record)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = []
    return out


def test_no_claim_passes_on_an_empty_list():
    """Every list any claim reads, emptied in turn (runs, seeds, calls, rows), fails that claim: a claim over runs
    holds for every run and never for none."""
    tried = 0
    for group, paths in RECORDS.items():
        record = json.loads((ROOT / paths[0]).read_text())
        for claim in [c for c in CLAIMS if c.group == group]:
            seen: set = set()
            claim.read(Tracked(record, (), seen))
            for path in sorted(seen, key=len):
                if any(isinstance(k, int) for k in path):
                    continue  # a list inside one run: its own emptying is covered by the outer list's
                try:
                    value = claim.read(emptied(record, path))
                except (KeyError, IndexError, TypeError, ZeroDivisionError, ValueError):
                    continue  # the check reports the record as lacking it: a failure
                assert not holds(value, claim.op, claim.bound), (claim.text, path)
                tried += 1
    assert tried >= 10


def test_every_claim_states_why_its_bound():
    assert all(len(c.why) > 20 for c in CLAIMS)


def test_numbers_are_read_at_their_printed_precision():
    assert numbers("0.27-0.32 -> 0.59 (+0.64 / -5.5 %), torch 2.13.0, H100, 6e-5") == [
        (0.27, 0.005), (0.32, 0.005), (0.59, 0.005), (0.64, 0.005), (-5.5, 0.05), (6e-5, 0.5e-5)]


def test_bad_groups_are_refused_before_reading():
    with pytest.raises(ValueError, match="unknown group"):
        check({"gpu_h300": "x.json"})
    with pytest.raises(ValueError, match="no claims in group"):
        check_record("gpu_h300", {})
    assert main(["--check", "gpu_h300=x.json"]) == 2
