"""Checks of the project as a whole: the code is lint-clean and the documentation builds with
every link and reference resolved."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.project


def test_ruff_finds_nothing_to_fix():
    pytest.importorskip("ruff")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- test-command", 1)[1].split("```bash\n", 1)[1]
    return block.split("\n```", 1)[0].strip()


def test_ci_runs_the_readme_test_command_and_installs_nothing_of_its_own():
    """What CI runs and what a newcomer runs are the same thing: .ci/run makes a fresh
    environment and runs README's test command, which installs what the tests need."""
    ci = (ROOT / ".ci" / "run").read_text()
    installs = [line for line in ci.splitlines()
                if "pip install" in line and "--upgrade pip" not in line]
    assert not installs, installs
    command = _readme_test_command()
    assert command.startswith("bash tests/install.sh && "), command
    assert "python -m pytest -q" in command and "ANYCCL_TEST_BACKEND=mpi" in command


def test_the_test_environment_fits_a_machine_without_a_gpu():
    """README's test command on a CPU machine brings no CUDA build of torch and no CUDA
    libraries (a [test] extra that asks for torch before a CPU torch is there pulls ~6 GB)."""
    from importlib import metadata

    from anyccl import gpu

    if gpu.device_count():
        pytest.skip("a GPU machine may carry CUDA builds on purpose")
    torch = pytest.importorskip("torch")
    assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"
    cuda = sorted({d.metadata["Name"] for d in metadata.distributions()
                   if (d.metadata["Name"] or "").lower().startswith("nvidia-")})
    assert not cuda, f"CUDA libraries installed on a machine without a GPU: {cuda}"
    install = (ROOT / "tests" / "install.sh").read_text()
    assert "download.pytorch.org/whl/cpu" in install


def test_the_docs_build_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    site = tmp_path / "site"
    front = (site / "index.html").read_text()
    assert "Install and run the demo" in front  # README is the front page
    api = (site / "api" / "index.html").read_text()
    assert "all_reduce" in api and "Communicator" in api  # generated from the docstrings
    _check_init_renders_every_parameter(api)
    assert 'href="stylesheets/extra.css"' in front   # code wraps, clear of the copy button
    style = (site / "stylesheets" / "extra.css").read_text()
    assert "pre-wrap" in style and "padding-right" in style
    from anyccl import settings

    page = (site / "settings" / "index.html").read_text()
    assert all(name in page for name in settings.SETTINGS)  # generated from the declarations
    results = ROOT / "benchmarks" / "results"
    for page in results.glob("*.md"):
        assert (site / "results" / page.stem / "index.html").is_file(), page.name
    shutil.rmtree(site)


def _check_init_renders_every_parameter(api: str) -> None:
    """The API page lists each of init()'s parameters in its parameter table (docstrings in
    the style mkdocstrings reads: a parameter is not an admonition, nor run into another), and
    no reStructuredText `::` leaks into the text."""
    import inspect

    import anyccl

    start = api.index('id="anyccl.init"')
    section = api[start:api.index('id="anyccl.Communicator"', start)]
    table = section.split("Parameters:", 1)[1].split("</table>", 1)[0]
    listed = re.findall(r'<tr class="doc-section-item">\s*<td>\s*<code>(\w+)</code>', table)
    assert listed == list(inspect.signature(anyccl.init).parameters), listed
    assert 'class="admonition' not in section, "a parameter rendered as an admonition"
    text = re.sub(r"<[^>]+>", "", api)
    assert not re.search(r"\w::\s", text), "reStructuredText '::' in the API page"


def test_every_link_in_the_docs_works_in_the_repository_too():
    """A link in docs/ names a file that exists where the page lies (the site's hook moves
    links to recorded runs where the site keeps them), so the docs read on a forge or in a
    checkout as they do on the site."""
    broken = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#")[0]
            if path and not re.match(r"[a-z]+:", path) and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_docs_install_anyccl_the_way_it_can_be_installed():
    """anyccl is installed from a checkout until it is published: no page sends a newcomer to
    `pip install anyccl`, which would fail."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    wrong = [str(p.relative_to(ROOT)) for p in pages
             if re.search(r"pip install ['\"]?anyccl\b", p.read_text())]
    assert not wrong, wrong


def test_no_page_points_at_an_example_that_is_not_there():
    """A page that says "the example above" shows one above: no page says it in prose."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text().lower()
        for phrase in ("example above", "example below", "see above", "as above"):
            assert phrase not in text, f"{page.relative_to(ROOT)}: '{phrase}'"


def test_no_paragraph_ends_on_a_colon_that_introduces_nothing():
    """A paragraph that ends with ':' is followed by what it announces (a list, code, a table,
    a picture), never by an unrelated paragraph."""
    dangling = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        lines, inside = page.read_text().splitlines(), False
        for i, line in enumerate(lines[:-2]):
            inside ^= line.startswith("```")
            if inside or not line.rstrip().endswith(":") or lines[i + 1].strip() or \
                    line.startswith(("#", "|", "    ", "- ", "* ")):
                continue
            if not re.match(r"\s*(```|- |\* |\d+\. |\||!\[|    |<)", lines[i + 2]):
                dangling.append(f"{page.relative_to(ROOT)}:{i + 1}: {line[-50:]}")
    assert not dangling, dangling


def test_the_settings_page_is_generated_from_the_declarations():
    from anyccl import settings

    page = (ROOT / "docs" / "settings.md").read_text()
    assert settings.table() in page, "docs/settings.md is stale: python docs/_hooks/results.py"


def test_every_recorded_run_the_code_and_docs_cite_exists():
    results = ROOT / "benchmarks" / "results"
    cited: dict[str, str] = {}
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "src").rglob("*.cu*"),
                 *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "docs").rglob("*.md"),
                 ROOT / "README.md", *(ROOT / "src").rglob("*.json")]:
        for name in re.findall(r"(20\d\d-\d\d-\d\d-[\w.-]+?\.(?:md|json|png))", path.read_text()):
            cited.setdefault(name, str(path.relative_to(ROOT)))
    assert cited, "found no citations at all: the pattern is wrong"
    missing = {name: where for name, where in cited.items() if not (results / name).is_file()}
    assert not missing, f"cited but not recorded: {missing}"


def test_the_host_time_benchmark_runs_anywhere_and_times_every_op_on_every_backend(tmp_path):
    out = tmp_path / "host-time.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_time.py"), "--calls",
                           "50", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.loads(out.read_text())["us_per_call"]
    for op in ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
               "reduce_scatter", "all_to_all", "send+recv"):
        assert set(table[op]) == {"shm", "host", "nccl", "ipc", "nccl-again", "ipc-again"}, \
            (op, table[op])
        assert all(t > 0 for t in table[op].values()), (op, table[op])
    assert "| all_reduce |" in proc.stdout
