"""Every link and repository path the README and docs/ name resolves inside the repository."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")                  # [text](target)
PATH = re.compile(r"`((?:mknumba|tests|benchmarks|examples|docs)/[\w./*-]+)`")   # `a/b.py`


def test_links_and_paths_resolve():
    bad = []
    for doc in DOCS:
        with open(doc) as f:
            text = f.read()
        here = os.path.dirname(doc)
        for target in LINK.findall(text):
            if "://" not in target and not os.path.exists(os.path.join(here, target)):
                bad.append(f"{os.path.relpath(doc, ROOT)}: link {target}")
        for path in PATH.findall(text):
            if not glob.glob(os.path.join(ROOT, path.rstrip("/"))):
                bad.append(f"{os.path.relpath(doc, ROOT)}: path {path}")
        for name in re.findall(r"\bDESIGN\.md\b|\.\./shared/", text):
            bad.append(f"{os.path.relpath(doc, ROOT)}: {name} lives outside the repository")
    assert not bad, "\n".join(bad)


def test_readme_api_table_names_real_parameters():
    """Each signature in the README's API table (a row's first cell, `mk.Name(arg, kw=...)`)
    names only parameters the callable has: a renamed argument fails here, not in a user's
    keyword call."""
    import inspect
    import mknumba as mk
    with open(DOCS[0]) as f:
        rows = [line for line in f if line.startswith("| `mk.")]
    assert len(rows) >= 10, "the README's API table moved"
    bad = []
    for row in rows:
        cell = row.split(" | ")[0]
        for name, args in re.findall(r"`mk\.([\w.]+)\(([^`]*?)\)`", cell):
            obj = mk
            for part in name.split("."):
                obj = getattr(obj, part, None)
            if obj is None:
                bad.append(f"mk.{name} does not exist")
                continue
            params = inspect.signature(obj).parameters
            if any(p.kind == p.VAR_KEYWORD for p in params.values()):
                continue
            for arg in (a.split("=")[0].strip() for a in args.split(",")):
                if arg.isidentifier() and arg not in params:
                    bad.append(f"mk.{name}: no parameter {arg!r} (has {list(params)})")
    assert not bad, "\n".join(bad)


def test_report_renders_every_committed_result():
    """`python benchmarks/report.py benchmarks/results/*.json` (the README's command) runs over
    every committed result file and prints one row per record that has a kernel and a shape."""
    import json
    import subprocess
    import sys
    files = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json")))
    records = []
    for path in files:
        with open(path) as f:
            data = json.load(f)
        records += data if isinstance(data, list) else []
    want = sum(1 for r in records if isinstance(r, dict) and "kernel" in r and "shape" in r)
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "report.py"), *files],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0].split()[:2] == ["kernel", "shape"], lines[:2]
    table = [line for line in lines[1:] if not line.startswith("(")]
    assert want > 100 and len(table) == want, (len(table), want)
