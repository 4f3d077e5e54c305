"""The documentation: the site builds, and the examples in its pages run against a live server.

``mkdocs build --strict`` fails on a missing page, a broken link or anchor, or a page left out of
the nav. Then every runnable example of ``docs/*.md`` and ``README.md`` runs against one
``radixlm serve`` of the tiny random-weight Llama, so a page cannot drift from the code.

The convention, for whoever writes a page:

- A fenced block tagged ``python`` runs as a script, in a subprocess of its own (180 s at most).
- A fenced block tagged ``bash``, ``sh`` or ``shell`` runs (``bash -euo pipefail``) when it calls
  ``curl``; there every ``curl`` fails on an HTTP error (``--fail-with-body``). Shell blocks
  without ``curl`` (``make serve``, ``radixlm serve --tp-size 2``) are shown, never run. Blocks
  with other tags (``json``, plain) never run.
- ``<!-- not-run: REASON -->`` on the line above the opening fence (blank lines between are
  allowed) exempts a block that would otherwise run; REASON is required, and a marker above a
  block that would not run anyway is an error (so the count of exemptions stays honest).
- Before a block runs, ``http://127.0.0.1:30000`` (where ``make serve`` listens) becomes the test
  server's URL, and every ``Engine(``, ``EngineBackend(`` and ``Runtime(`` call gets the tiny
  model's ``model_path=`` as its first argument (the pages show the embedded SmolLM2). The
  ``model`` field of the OpenAI examples is only echoed, so it stays as written.
- Only success is checked (exit status 0): outputs of a random-weight model are gibberish.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import missing_under_ci

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
DOCS_URL = "http://127.0.0.1:30000"
MIN_RUNNABLE = 30  # fewer means examples were lost or the extraction broke: it must never run none
SHELL_TAGS = {"bash", "sh", "shell"}
FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not-run:(.*?)-->\s*$")
ENGINE_CALL = re.compile(r"\b(Engine|EngineBackend|Runtime)\(")
PY_TIMEOUT_S = 180
CURL_PRELUDE = 'curl() { command curl --silent --show-error --fail-with-body --max-time 120 "$@"; }\n'


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    tag: str
    code: str
    not_run: str | None  # the reason, when the page exempts it

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def is_example(self) -> bool:
        """Python, or a shell block that calls curl: what the convention runs."""
        return self.tag == "python" or (self.tag in SHELL_TAGS and re.search(r"(^|[\s;&|(])curl\s", self.code) is not None)


def extract_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, with the not-run marker above each (if any)."""
    blocks: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, tag = i, m.group(1).lower()
        j = start + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path.name}:{start + 1}: a code fence is never closed")
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = NOT_RUN.match(lines[k].strip()) if k >= 0 else None
        reason = marker.group(1).strip() if marker else None
        if marker and not reason:
            raise AssertionError(f"{path.name}:{start + 1}: a not-run marker needs a reason")
        blocks.append(Block(str(path.relative_to(ROOT)), start + 1, tag, "\n".join(lines[start + 1 : j]) + "\n", reason))
        i = j + 1
    return blocks


ALL_BLOCKS = [b for page in PAGES for b in extract_blocks(page)]
EXAMPLES = [b for b in ALL_BLOCKS if b.is_example]
RUNNABLE = [b for b in EXAMPLES if b.not_run is None]


def test_the_convention_holds():
    """Enough examples run, every exemption has a reason and exempts a block that would run."""
    stale = [b.id for b in ALL_BLOCKS if b.not_run is not None and not b.is_example]
    assert not stale, f"not-run markers above blocks that would not run anyway: {stale}"
    assert len(RUNNABLE) >= MIN_RUNNABLE, f"only {len(RUNNABLE)} runnable examples found (at least {MIN_RUNNABLE} expected)"
    assert any(b.page == "README.md" for b in RUNNABLE), "the README's tour must run"
    exempt = {b.id: b.not_run for b in EXAMPLES if b.not_run is not None}
    print(f"{len(RUNNABLE)} examples run, {len(exempt)} not run: {exempt}")


def test_site_builds_strictly(tmp_path: Path):
    """``mkdocs build --strict``: every page exists, every link and anchor resolves."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        missing_under_ci("mkdocs or mkdocs-material is not installed (the dev extra installs both)")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_links_resolve():
    """The README is not part of the site (mkdocs never checks it): its relative links must exist."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = [t for t in targets if "://" not in t and not (ROOT / t.split("#")[0]).exists()]
    assert targets and not broken, f"README links to missing files: {broken}"


@pytest.fixture(scope="module")
def docs_env(tiny_server, tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Where and how the examples run: the shared tiny server, a scratch folder, a clean environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("RADIXLM_API_KEY", "RADIXLM_ADMIN_API_KEY", "OPENAI_API_KEY", "OPENAI_BASE_URL")}
    return {"url": tiny_server.base_url, "model": tiny_llama, "cwd": tmp_path_factory.mktemp("doc_examples"), "env": env, "server": tiny_server}


def substitute(code: str, url: str, model_path: str) -> str:
    """The page's code, aimed at the test server and the tiny model (see the module's docstring)."""
    return ENGINE_CALL.sub(lambda m: f"{m.group(1)}(model_path={model_path!r}, ", code.replace(DOCS_URL, url))


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_example_runs(block: Block, docs_env: dict):
    code = substitute(block.code, docs_env["url"], docs_env["model"])
    if block.tag == "python":
        script = docs_env["cwd"] / (re.sub(r"\W", "_", block.id) + ".py")
        script.write_text(code, encoding="utf-8")
        cmd = [sys.executable, str(script)]
    else:
        if shutil.which("curl") is None:
            missing_under_ci("curl is not installed")
        cmd = ["bash", "-euo", "pipefail", "-c", CURL_PRELUDE + code]
    try:
        proc = subprocess.run(cmd, cwd=docs_env["cwd"], env=docs_env["env"], capture_output=True, text=True, timeout=PY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.id}: still running after {PY_TIMEOUT_S} s", pytrace=False)
    if proc.returncode != 0:
        tail = docs_env["server"].output()[-3000:]
        pytest.fail(f"{block.id} ({block.tag}) exited {proc.returncode}\n--- code as run:\n{code}\n--- stdout:\n{proc.stdout[-3000:]}\n--- stderr:\n{proc.stderr[-5000:]}\n--- server log (tail):\n{tail}", pytrace=False)
