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
