"""Every link in README.md and docs/*.md leads somewhere: relative links and images name
files or folders that exist, `#anchors` name a heading of their page (GitHub's slugs),
and every `docs/results/...` path, repository path in backticks and
`python -m dspine_benchmarks.NAME`-style module the text cites exists.

Plain text parsing, no network: external (http, mailto) links are not followed.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
RESULTS_PATH = re.compile(r"docs/results/[\w.\-/]+")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
MODULE = re.compile(r"\b(dspine_benchmarks|dspine_train|dspine_serve)\.([a-z0-9_]+)")
PACKAGE_DIRS = {"dspine_benchmarks": "benchmarks", "dspine_train": "train",
                "dspine_serve": "serve"}
# First path components of the repository's own files (a backticked `train/x.py` must
# exist; `runs/...`, `export/...` and the like are a user's output folders).
REPO_DIRS = ("benchmarks", "docs", "dspine_jax", "dspine_torch", "notebooks",
             "pallas_kernels", "serve", "tests", "tools", "train")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (a `# comment` in a bash block is not a
    heading), in order."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text (code spans, emphasis and links
    reduced to their words), lowercased, every character that is not a letter, mark,
    number, underscore, space or hyphen dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # [words](url) -> words
    text = text.replace("`", "").replace("*", "")
    kept = [c for c in text.lower()
            if c in " -_" or unicodedata.category(c)[0] in "LMN"]
    return "".join(kept).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's slug; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def links(page: Path) -> list[str]:
    text = "\n".join(prose_lines(page.read_text(encoding="utf-8")))
    return [m.group(1) for m in LINK.finditer(text)]


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.\-]*:", target):   # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            shown = dest.relative_to(root) if dest.is_relative_to(root) else dest
            problems.append(f"{target}: {shown} does not exist")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading of {dest.name} has the anchor #{anchor}")
    return problems


def missing_cited_paths(page: Path, root: Path = ROOT) -> list[str]:
    text = page.read_text(encoding="utf-8")
    problems = []
    for match in RESULTS_PATH.finditer(text):
        path = match.group(0).rstrip(".")
        if not (root / path).exists():
            problems.append(f"{path} does not exist")
    for match in CODE_SPAN.finditer(text):
        span = match.group(1).strip()
        if (span.split("/")[0] in REPO_DIRS and "/" in span and " " not in span
                and not span.startswith("docs/results/")   # checked above
                and not re.search(r"[*{}<>|]|[A-Z]{2,}", span)):
            path, _, test_name = span.partition("::")      # tests/x.py::test_name
            file = root / path.rstrip("/")
            if not file.exists():
                problems.append(f"`{span}` does not exist")
            elif test_name and not re.search(rf"^\s*def {re.escape(test_name)}\(",
                                             file.read_text(encoding="utf-8"), re.M):
                problems.append(f"`{span}`: {path} defines no {test_name}")
    for match in MODULE.finditer(text):
        package, name = match.groups()
        folder = root / PACKAGE_DIRS[package]
        if not ((folder / f"{name}.py").exists() or (folder / name).is_dir()):
            problems.append(f"{package}.{name}: no {PACKAGE_DIRS[package]}/{name}.py")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    assert not broken_links(page), "\n".join(broken_links(page))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_paths_and_modules_exist(page):
    assert not missing_cited_paths(page), "\n".join(missing_cited_paths(page))


@pytest.mark.parametrize("heading, slug", [
    ("Decoding with the shipped drafters", "decoding-with-the-shipped-drafters"),
    ("Why the lead vanishes at T = 1", "why-the-lead-vanishes-at-t--1"),
    ("The recipe's ablations on 44.5 k answers", "the-recipes-ablations-on-445-k-answers"),
    ("CPU: the README's first command", "cpu-the-readmes-first-command"),
    ("The `dspine` command", "the-dspine-command"),
    ("11. Ablation switches", "11-ablation-switches"),
    ("Speed, τ and [links](x.md)", "speed-τ-and-links"),
])
def test_github_slugs(heading, slug):
    assert github_slug(heading) == slug


def test_the_checks_catch_a_broken_link_anchor_and_path(tmp_path):
    """A page with one of each defect is flagged for each, and only for those."""
    (tmp_path / "docs" / "results" / "run").mkdir(parents=True)
    (tmp_path / "train").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_here():\n    pass\n")
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Title\n\n```bash\n# not a heading\n[no](missing-in-fence.md)\n```\n"
        "[ok](other.md#a-section) [ok](#title) [ok](docs/results/run/) [web](https://x.y)\n"
        "[bad file](gone.md) [bad anchor](other.md#nope) [bad own anchor](#not-a-heading)\n"
        "raw in `docs/results/run/` and `docs/results/old-run/x.json`;\n"
        "`train/gone.py`, `train/configs/*.toml`, `runs/anything`,\n"
        "`tests/test_x.py::test_here`, `tests/test_x.py::test_gone`,\n"
        "python -m dspine_benchmarks.no_such_script\n")
    assert sorted(p.split(":")[0] for p in broken_links(page, tmp_path)) == [
        "#not-a-heading", "gone.md", "other.md#nope"]
    assert missing_cited_paths(page, tmp_path) == [
        "docs/results/old-run/x.json does not exist", "`train/gone.py` does not exist",
        "`tests/test_x.py::test_gone`: tests/test_x.py defines no test_gone",
        "dspine_benchmarks.no_such_script: no benchmarks/no_such_script.py"]
