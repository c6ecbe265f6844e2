"""`eagle3-ray bench <name>`: one subcommand per benchmark with only its own flags; every bench
command line written in the docs, scripts and docstrings still parses; --schedule's forms."""
import argparse
import glob
import json
import os
import re
import shlex

import pytest

from eagle3_ray.bench import cli as bench_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHES = {"extract", "train", "quality", "recipe", "sweep", "serve", "engines", "regen",
           "storage", "online", "load"}


def bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    bench_cli.add_bench_args(p)
    return p


def written_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `bench`) of every concrete `eagle3-ray bench ...` / `jobs/bench.py ...`
    line in docs/, README.md, scripts/ and the package's sources (continuations joined; lines
    with placeholders such as `...`, `[--flag]`, `<name>`, `$VAR` left out)."""
    files = (glob.glob(os.path.join(ROOT, "docs", "*.md")) + [os.path.join(ROOT, "README.md")]
             + glob.glob(os.path.join(ROOT, "scripts", "*.sh"))
             + glob.glob(os.path.join(ROOT, "jobs", "*.py"))
             + glob.glob(os.path.join(ROOT, "eagle3_ray", "**", "*.py"), recursive=True))
    out = []
    for path in files:
        with open(path) as f:
            text = re.sub(r"\\\\?\n\s*", " ", f.read())          # join continuations
        if path.endswith(".md"):
            text = _join_wrapped_code(text)
        for m in re.finditer(r"(?:eagle3-ray bench|jobs/bench\.py) ([^\n`|;&>#]*)", text):
            line = m.group(1).strip().rstrip('"\'').strip()
            if not line or re.search(r"\.\.\.|\[|<|\$|\{|NAME|\bN\b", line):
                continue
            try:
                argv = shlex.split(line)
            except ValueError:
                continue
            if len(argv) > 1 and argv[0] in BENCHES:         # a bare name is prose
                out.append((f"{os.path.relpath(path, ROOT)}: {line}", argv))
    return out


def _join_wrapped_code(text: str) -> str:
    """Markdown prose wrapped inside an `inline code` span: its lines joined."""
    out, buf = [], ""
    for ln in text.split("\n"):
        if ln.lstrip().startswith("```") and not buf:
            out.append(ln)
            continue
        buf = f"{buf} {ln}" if buf else ln
        if buf.count("`") % 2 == 0:
            out.append(buf)
            buf = ""
    return "\n".join(out + [buf])


def test_each_bench_has_its_own_subcommand_and_only_its_flags():
    p = bench_parser()
    sub = p._subparsers._group_actions[0].choices
    assert set(sub) == BENCHES
    for name, sp in sub.items():        # the shared flags everywhere, one helper
        assert "--out" in sp._option_string_actions, name
    a = p.parse_args(["train", "--with-block"])
    assert (a.what, a.with_block, a.out, a.bench_run) == ("train", True, "runs/bench",
                                                          bench_cli._run_train)
    with pytest.raises(SystemExit):     # another bench's flag is refused, not ignored
        p.parse_args(["train", "--samples", "4"])
    with pytest.raises(SystemExit):
        p.parse_args(["regen", "--drafter", "D"])
    with pytest.raises(SystemExit):     # engines needs its drafter
        p.parse_args(["engines"])
    assert p.parse_args(["storage"]).samples == 600 and p.parse_args(["serve"]).samples == 8
    a = p.parse_args(["load", "--drafter", "D", "--engines", "builtin", "--concurrency", "1",
                      "2", "--prompts", "4", "--max-tokens", "8"])
    assert (a.engines, a.concurrency, a.prompts, a.max_tokens, a.depth) == (
        ["builtin"], [1, 2], 4, 8, [3])
    a = p.parse_args(["load", "--depth", "1", "2", "3", "--schedule", "auto", "--profile", "P"])
    assert (a.depth, a.schedule, a.profile) == ([1, 2, 3], "auto", "P")
    assert "--address" in sub["load"]._option_string_actions
    assert "--address" not in sub["train"]._option_string_actions


def test_every_written_bench_command_parses():
    p = bench_parser()
    seen = written_commands()
    assert len(seen) > 20
    for where, argv in seen:
        try:
            p.parse_args(argv)
        except SystemExit:
            pytest.fail(f"does not parse: {where}")


def test_eagle3_ray_bench_runs_the_subcommand(monkeypatch):
    from eagle3_ray import cli
    got = {}
    monkeypatch.setattr(cli, "run_main", lambda fn, a: got.update(fn=fn, a=a) or 0)
    assert cli.main(["bench", "extract", "--engines", "--samples", "32"]) == 0
    assert got["fn"] is cli.cmd_bench and got["a"].bench_run is bench_cli._run_extract
    assert (got["a"].what, got["a"].engines, got["a"].samples) == ("extract", True, 32)


def test_schedule_forms(tmp_path):
    assert bench_cli.read_schedule(None) is None
    assert bench_cli.read_schedule("[[1, 4, 3], [5, 256, 0]]") == [[1, 4, 3], [5, 256, 0]]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"kind": "depth_schedule", "schedule": [[1, 8, 2]]}))
    assert bench_cli.read_schedule(str(path)) == [[1, 8, 2]]
    for bad in ("[[4, 1, 3]]", "[[0, 2, 1]]", "[[1, 2]]", "not json", '{"depth": 3}'):
        with pytest.raises(SystemExit, match="schedule|JSON"):
            bench_cli.read_schedule(bad)
