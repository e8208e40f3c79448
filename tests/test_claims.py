"""The claims of `docs/results.md` hold on the records it cites (`benchmarks/claims.py --check`), every such record is
cited there, and a record that no longer supports a claim fails exactly that claim. Reading JSON only: cheap."""

import json
import re
from pathlib import Path

import pytest

from benchmarks.claims import CLAIMS, RECORDS, check, check_record, main

ROOT = Path(__file__).resolve().parents[1]


def test_every_published_claim_holds_on_its_record():
    lines = check()
    assert len(lines) >= len(CLAIMS)
    assert not [line for line in lines if not line.startswith("ok")]


def test_every_checked_record_is_the_one_results_cites():
    results = (ROOT / "docs/results.md").read_text(encoding="utf-8")
    cited = set(re.findall(r"\]\(\.\./([^)#\s]+)\)", results))
    assert not [p for paths in RECORDS.values() for p in paths if p not in cited]


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


def test_bad_groups_are_refused_before_reading():
    with pytest.raises(ValueError, match="unknown group"):
        check({"gpu_h300": "x.json"})
    with pytest.raises(ValueError, match="no claims in group"):
        check_record("gpu_h300", {})
    assert main(["--check", "gpu_h300=x.json"]) == 2
