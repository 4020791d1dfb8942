"""The documentation stays true to the tree: README.md is a front door (short), every relative link in README.md and
docs/*.md (and bench/README.md) reaches a file, and an anchor a heading there, and every module path the prose
names (`engine/core.py`, ...) exists, so a module that moves takes its mentions along."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 220
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
MODULE_PATH = re.compile(r"(?<![\w./-])((?:model|engine|app|training|bench)/[\w/]*\w\.py)\b")
FENCE = re.compile(r"^\s*(```|~~~)")


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


def prose(text: str) -> str:
    """The text without fenced code blocks (a `# comment` in a shell block is no heading, a URL there no link)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, '-', '_' and spaces kept),
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()  # a link's text only
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in prose(path.read_text()).splitlines():
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(m.group(1))
            a, n = base, 0
            while a in found:  # GitHub numbers repeated headings: x, x-1, x-2
                n += 1
                a = f"{base}-{n}"
            found.add(a)
    return found


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text()))


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)  # http:, https:, mailto:, ...


def test_readme_is_a_front_door():
    n = len((REPO / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_relative_links_reach_a_file_and_heading(doc):
    broken = []
    for target in filter(relative, links(doc)):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {_name(dest)}")
    assert broken == [], f"{_name(doc)}: broken links: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_module_paths_exist(doc):
    missing = sorted({p for p in MODULE_PATH.findall(doc.read_text()) if not (REPO / p).exists()})
    assert missing == [], f"{_name(doc)} names modules that do not exist: {missing}"


def test_the_checks_see_a_broken_link_and_a_moved_module(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("# Title\n\nSee [a](missing.md), [b](#title), [c](#nowhere), [d](https://example.com/x.md) and "
                   "`model/engine_core.py`.\n\n```\n[e](also-missing.md)\n```\n")
    targets = [t for t in links(doc) if relative(t)]
    assert targets == ["missing.md", "#title", "#nowhere"]
    assert "title" in anchors(doc) and "nowhere" not in anchors(doc)
    assert MODULE_PATH.findall(doc.read_text()) == ["model/engine_core.py"]
    assert not (REPO / "model/engine_core.py").exists()


def test_slug_matches_githubs():
    assert slug("`POST /v1/completions`") == "post-v1completions"
    assert slug("The serving stack's ceiling (2026-11-22, 2-vCPU Intel Xeon VM, no GPU)") == \
        "the-serving-stacks-ceiling-2026-11-22-2-vcpu-intel-xeon-vm-no-gpu"
    assert slug("vLLM and llama.cpp (2026-11-24, AVX-512/AMX)") == "vllm-and-llamacpp-2026-11-24-avx-512amx"
