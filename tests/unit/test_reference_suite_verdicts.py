"""How the driver of Horovod's own test_torch.py reads verdicts, continues an earlier run and merges
shares (tests/parallel/ops_reference_suite.py, benchmarks/gpu_ops_summary.py): the logic a GPU call's
verdicts go through, checked without Horovod."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


suite = _load("ops_reference_suite", ROOT / "tests" / "parallel" / "ops_reference_suite.py")
summary = _load("gpu_ops_summary", ROOT / "benchmarks" / "gpu_ops_summary.py")
plugin = _load("reference_suite_plugin", suite.PLUGIN)

A, B, C = ("test_torch.py::TorchTests::test_a", "test_torch.py::TorchTests::test_b", "test_torch.py::TorchTests::test_c")


def _run(path: Path, mode: str, tests: dict[str, str], shard: str = "0/1") -> str:
    path.write_text(json.dumps({"mode": mode, "np": 2, "hosts": "localhost:2", "controller": "--gloo",
                                "shard": shard, "counts": {}, "jobs": 1, "retried": [], "tests": tests}))
    return str(path)


def test_verdict_lines_of_class_and_module_tests_are_read():
    lines = ("[1]<stdout>:test_torch.py::TorchTests::test_a PASSED\n"
             "[0]<stdout>:test_tiny.py::test_b FAILED\n")
    found = {m.group(1).split(">:")[-1]: m.group(2) for m in suite.VERDICT.finditer(lines)}
    assert found == {"test_torch.py::TorchTests::test_a": "PASSED", "test_tiny.py::test_b": "FAILED"}


def test_pytest_timeouts_banner_marks_a_hang():
    assert suite.TIMEOUT_MARK.search("[0]<stderr>:" + "+" * 35 + " Timeout " + "+" * 35)
    assert not suite.TIMEOUT_MARK.search("[0]<stdout>:test_torch.py::TorchTests::test_timeout_x PASSED")


def test_an_earlier_runs_verdicts_are_kept_except_notrun(tmp_path):
    first = _run(tmp_path / "a.json", "stock", {A: "PASSED", B: "NOTRUN", C: "CRASH"})
    later = _run(tmp_path / "b.json", "stock", {A: "FAILED"})
    # the later file wins, NOTRUN is not a verdict, and tests outside this share are left out
    assert suite._earlier_verdicts([first, later], "stock", [A, B]) == {A: "FAILED"}
    assert suite._earlier_verdicts([first], "stock", [A, B, C]) == {A: "PASSED", C: "CRASH"}


def test_an_earlier_run_of_the_other_mode_is_refused_by_name(tmp_path):
    blink = _run(tmp_path / "hvdtest_blink.json", "BLINK_ENABLE=1", {A: "PASSED"})
    with pytest.raises(SystemExit, match=r"hvdtest_blink\.json: a run with mode 'BLINK_ENABLE=1', this one is 'stock'"):
        suite._earlier_verdicts([blink], "stock", [A])


def test_shares_and_continued_calls_merge_per_mode(tmp_path):
    _run(tmp_path / "hvdtest_0of2.json", "stock", {A: "PASSED", C: "NOTRUN"}, "0/2")
    _run(tmp_path / "hvdtest_1of2.json", "stock", {B: "CRASH"}, "1/2")
    _run(tmp_path / "hvdtest_z.json", "stock", {C: "ERROR", A: "NOTRUN"})  # a later call: NOTRUN keeps A's verdict
    _run(tmp_path / "hvdtest_blink_0of1.json", "BLINK_ENABLE=1", {A: "PASSED", B: "XFAIL", C: "NOTRUN"})
    runs = summary._hvdtest_runs(tmp_path)
    assert set(runs) == {"stock", "BLINK_ENABLE=1"}
    assert runs["stock"]["tests"] == {A: "PASSED", B: "CRASH", C: "ERROR"}
    assert runs["stock"]["counts"] == {"PASSED": 1, "CRASH": 1, "FAILED": 1}
    assert runs["stock"]["shards"] == ["0/2", "1/2", "0/1"] and runs["stock"]["files"] == 3
    assert runs["BLINK_ENABLE=1"]["counts"] == {"PASSED": 1, "SKIPPED": 1, "NOTRUN": 1}


def test_cuda_ordinals_past_the_visible_gpus_are_placed_on_them():
    torch = pytest.importorskip("torch")
    m = plugin.shared_ordinal
    # one GPU shared by two local ranks: rank 1's cuda:1 is the one GPU
    assert m(1, 1) == 0 and m(0, 1) == 0 and m(5, 2) == 1 and m(1, 2) == 1
    assert m("cuda:1", 1) == "cuda:0" and m("cuda:3", 2) == "cuda:1" and m("cuda:1", 2) == "cuda:1"
    assert m(torch.device("cuda", 1), 1) == torch.device("cuda", 0)
    # what names no CUDA ordinal is left as it is
    for other in ("cuda", "cpu", torch.float16, torch.device("cpu"), torch.device("cuda"), True, None):
        assert m(other, 1) == other
    # the plugin is loaded into every rank's pytest by name, from the folder put on PYTHONPATH
    assert suite.PLUGIN.exists()


def test_a_failure_reason_is_its_E_lines_on_one_line():
    text = "    def test_x(self):\n>       assert 1 == 2\nE       assert 1 == 2\nE        +  where x\n\nfile.py:3: AssertionError"
    assert plugin.failure_reason(text) == "assert 1 == 2 | +  where x"
    assert plugin.failure_reason("a\nb\nc\nd") == "b | c | d"
    # the printed line carries no "ID VERDICT" pair the driver would read as a verdict
    assert not suite.VERDICT.search(f"{plugin.PREFIX} failure in call of {A} - FAILED to converge")


def test_the_differing_verdicts_are_named_for_a_run_alone(tmp_path, capsys, monkeypatch):
    _run(tmp_path / "hvdtest_0of1.json", "stock", {A: "PASSED", B: "FAILED", C: "NOTRUN"})
    _run(tmp_path / "hvdtest_blink_0of1.json", "BLINK_ENABLE=1", {A: "FAILED", B: "FAILED", C: "PASSED"})
    both, diff = summary._hvdtest_compared(summary._hvdtest_runs(tmp_path))
    # C has no verdict on the stock side: not compared, so not run again
    assert both == [A, B] and diff == {A: ("PASSED", "FAILED")}
    (tmp_path / "alone.json").write_text(json.dumps({"tests": {A: "PASSED"}}))
    (tmp_path / "alone_blink.json").write_text(json.dumps({"tests": {A: "PASSED"}}))
    monkeypatch.setattr("sys.argv", ["gpu_ops_summary.py", str(tmp_path)])
    summary.main()
    assert "(stock, blink): test_a (PASSED, PASSED)" in capsys.readouterr().out


def test_steps_that_did_not_run_are_said_so_not_counted_as_failed(tmp_path, capsys, monkeypatch):
    # np2's jobs ran and the Blink one left no weights: a failure; np4 and the step times never ran
    (tmp_path / "train_np2_stock.log").write_text("")
    (tmp_path / "train_np2_blink.log").write_text("")
    (tmp_path / "step_float32_1.log").write_text("no STEP line\n")
    monkeypatch.setattr("sys.argv", ["gpu_ops_summary.py", str(tmp_path)])
    summary.main()
    out = capsys.readouterr().out
    assert "- np2: missing (a job failed: see its log)" in out
    assert "- np4: not run" in out
    assert "| float32 | blink | - | - | - | - | no result |" in out
    assert "| float32 | stock | - | - | - | - | not run |" in out
