"""The command line and the job entrypoint fail fast and clearly on bad input (no Ray started)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, cwd=ROOT):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_missing_input_exits_2_naming_it(tmp_path):
    r = run(["-m", "eagle3_ray.cli", "extract", "--inputs", str(tmp_path / "nope.json"),
             "--output", str(tmp_path / "out")])
    assert r.returncode == 2
    assert f"eagle3-ray: error: input not found: {tmp_path / 'nope.json'}" in r.stderr
    assert not (tmp_path / "out").exists()


def test_job_entrypoint_runs_from_any_cwd_and_rejects_bad_verifier(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"messages": []}\n')
    r = run([os.path.join(ROOT, "jobs", "extract.py"), "--inputs", str(tmp_path / "c.jsonl"),
             "--verifier", str(tmp_path), "--output", str(tmp_path / "out")], cwd=tmp_path)
    assert r.returncode == 2 and "expected a directory with config.json" in r.stderr
