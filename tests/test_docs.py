"""The README and docs/: a short front door, links and anchors that resolve, every page linked,
every command's --help naming its page. Fast; no model."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(path: Path) -> str:
    """The page without its fenced code blocks (whose '#' lines are comments, not headings)."""
    return _FENCE.sub("", path.read_text(encoding="utf-8"))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, punctuation other than '-'
    and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in _HEADING.findall(_prose(path)):
        s = _slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def _links(path: Path) -> list[str]:
    return [t for t in _LINK.findall(_CODE.sub("", _prose(path))) if not re.match(r"[a-z]+:", t)]


def test_slug_follows_github():
    assert _slug("Past answers: the datastore and the budgeted tree") == (
        "past-answers-the-datastore-and-the-budgeted-tree"
    )
    assert _slug("Training across processes and machines (mlx.distributed)") == (
        "training-across-processes-and-machines-mlxdistributed"
    )
    assert _slug("Memory: a 4,000-token conversation") == "memory-a-4000-token-conversation"
    assert _slug("`--tree auto`") == "--tree-auto"


def test_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move detail to docs/ (at most 300)"


def test_docs_exist():
    assert DOCS, "docs/*.md missing"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for target in _links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


def test_every_doc_linked_from_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(README) if t.partition("#")[0]}
    missing = [d.name for d in DOCS if d.resolve() not in linked]
    assert not missing, f"docs not linked from README.md: {missing}"


def test_every_command_help_names_its_doc():
    import typer
    from typer.testing import CliRunner

    from mlx_stream.cli import app

    runner = CliRunner()
    names = [[]] + [[name] for name in typer.main.get_command(app).commands]
    assert len(names) > 5
    for name in names:
        r = runner.invoke(app, [*name, "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0, (name, r.output)
        docs = re.findall(r"docs/[\w-]+\.md", r.output)
        assert docs, f"`mlx-stream {' '.join(name)} --help` names no docs/ page"
        for d in docs:
            assert (ROOT / d).is_file(), f"`mlx-stream {' '.join(name)} --help` names missing {d}"
