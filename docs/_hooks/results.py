"""mkdocs hook: pages made from the repository itself. README.md is the site's front page (its
links made relative to docs/), the recorded runs in benchmarks/results/ become pages of the
site (results/...), and the benchmarks page lists them, newest first, each with its own first
heading.

docs/settings.md is generated from `anyccl.settings` by running this file
(`python docs/_hooks/results.py`); a test checks that it is up to date."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = "<!-- results-list -->"


def front_page() -> str:
    """README.md with its links pointing where the site keeps the same files."""
    text = (ROOT / "README.md").read_text()
    return text.replace("](docs/", "](").replace("](benchmarks/results/", "](results/")


SETTINGS_INTRO = """# Settings

Every `ANYCCL_*` environment variable anyccl reads, generated from `anyccl.settings`, where each
is declared once. Sizes accept `64K`, `16M`, `1G`; a bare number is read in the unit the
variable's name carries. A value that does not parse is an `InvalidArgumentError` naming the
variable, raised by `anyccl.init()` (or when the backend that reads it is created).

"""


def settings_page() -> str:
    sys.path.insert(0, str(ROOT / "src"))
    try:
        from anyccl import settings, tuning
    finally:
        sys.path.pop(0)
    return SETTINGS_INTRO + settings.table() + "\n" + TUNING_INTRO + tuning.markdown() + "\n"


TUNING_INTRO = """
## The tuning table

Every size threshold that picks an algorithm, for every backend, declared once in
`anyccl.tuning`; `anyccl info` prints the values in force. `ANYCCL_TUNING` overrides any of
them, as `key=value` pairs separated by commas (`ANYCCL_TUNING="shm.one_shot_max=64K"`); set it
the same on every rank, since the ranks of a job pick the same schedule only from the same table.
The ipc backend's `auto` policy routes sizes to its kernels or to NCCL by tables of its own,
each measured on one machine shape by `anyccl tune` (the cache `ANYCCL_ROUTES_FILE`, then the
shipped `backends/ipc/routes.json`; a shape never measured runs on NCCL), which `anyccl info`
prints too.

"""


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "index.md", content=front_page()))
    for path in sorted(RESULTS.iterdir()):
        if path.suffix in (".md", ".png"):
            files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    return files


def _title(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def on_page_markdown(markdown: str, page, config, files) -> str:
    # the docs link recorded runs where they lie in the repository (so the links work there
    # too); the site keeps them under results/
    depth = page.file.src_uri.count("/")
    markdown = markdown.replace("](" + "../" * (depth + 1) + "benchmarks/results/",
                                "](" + "../" * depth + "results/")
    if MARKER not in markdown:
        return markdown
    rows = [f"- [{p.stem}](results/{p.name}): {_title(p)}"
            for p in sorted(RESULTS.glob("*.md"), reverse=True)]
    return markdown.replace(MARKER, "\n".join(rows))


if __name__ == "__main__":
    (ROOT / "docs" / "settings.md").write_text(settings_page())
