"""Every Python block of the guides in `docs/` runs as written, so a page cannot drift from the code.

The convention the pages follow:

* A ```` ```python ```` block runs, with its imports, data and definitions, unless the line right before its
  fence is `<!-- fragment -->`. A fragment is shown and not run: it needs what this machine lacks (a GPU, a Ray
  cluster, several processes started by `meshfit launch`, a long run) or shows a part of a program the page
  describes. Prefer a block that runs with small sizes to a fragment.
* A page's runnable blocks run in order in one namespace (a later block uses an earlier one's names), in a
  process of their own whose working directory is a fresh temporary folder: relative paths land there, and
  so do the pages' `/tmp/...` paths (`/tmp/` is read as that folder), so no run meets another's files.
* A page whose blocks need 8 devices says so, in its text for the reader and with the line
  `<!-- docs-test: 8 devices -->` for this test: it runs on 8 simulated CPU devices
  (`XLA_FLAGS=--xla_force_host_platform_device_count=8`). Any other page runs on one CPU device, as a reader's
  laptop would.
"""

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes  # each page runs in a process of its own: the tier CI runs after the README's

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DOCS = os.path.join(ROOT, "docs")
FRAGMENT = "<!-- fragment -->"
EIGHT_DEVICES = "<!-- docs-test: 8 devices -->"
FENCE = re.compile(r"^(\s*)```python(\s.*)?$")  # indented inside a tab; a title may follow: ```python title="t.py"


#: Runs a page's blocks in one namespace; a failing block is named by its first line in the page.
RUNNER = """
import json, os, sys, traceback
path, blocks = sys.argv[1], json.loads(sys.stdin.read())
namespace = {"__name__": "__main__"}
for line, source in blocks:
    source = source.replace("/tmp/", os.getcwd() + "/")
    try:
        exec(compile(source, f"{path}:{line}", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"the block at {path}:{line} failed")
"""


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """`(line of the fence, source, is_fragment)` for each ```python block of a Markdown text, in order."""
    lines = text.split("\n")
    blocks = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence:
            indent = len(fence.group(1))
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            source = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
            fragment = i > 0 and lines[i - 1].strip() == FRAGMENT
            blocks.append((i + 1, source, fragment))
            i = end
        i += 1
    return blocks


PAGES = sorted(name for name in os.listdir(DOCS) if name.endswith(".md"))


def test_blocks_and_fragments_are_found():
    text = (
        'x\n```python\na = 1\n```\n<!-- fragment -->\n```python title="t.py"\nb = a\n```\n```bash\nls\n```\n'
        '=== "tab"\n\n    ```python\n    if a:\n        c = 2\n    ```\n'
    )
    assert python_blocks(text) == [(2, "a = 1\n", False), (6, "b = a\n", True), (14, "if a:\n    c = 2\n", False)]


def test_every_page_says_what_it_needs_of_its_blocks():
    """A marker is either on a page's first lines or right before a fence, never stray."""
    for name in PAGES:
        lines = open(os.path.join(DOCS, name)).read().split("\n")
        for i, line in enumerate(lines):
            if line.strip() == FRAGMENT:
                assert i + 1 < len(lines) and FENCE.match(lines[i + 1]), f"{name}:{i + 1}: a stray {FRAGMENT}"
            if line.strip() == EIGHT_DEVICES:
                assert i < 40, f"{name}:{i + 1}: {EIGHT_DEVICES} belongs near the page's top, where the reader is told"


@pytest.mark.slow  # every page with runnable blocks trains a model
@pytest.mark.parametrize("page", PAGES)
def test_the_pages_python_blocks_run_as_written(page, tmp_path):
    """The page's runnable blocks, in order in one process, under the devices the page asks for."""
    text = open(os.path.join(DOCS, page)).read()
    blocks = [(line, source) for line, source, fragment in python_blocks(text) if not fragment]
    if not blocks:
        pytest.skip(f"{page} has no runnable Python block")
    env = dict(os.environ, JAX_PLATFORMS="cpu", KERAS_BACKEND="jax")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))  # `examples` imports
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).split()
    if EIGHT_DEVICES in text:
        flags.append("--xla_force_host_platform_device_count=8")
    env["XLA_FLAGS"] = " ".join(flags)
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, f"docs/{page}"],
        input=json.dumps(blocks),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode:
        pytest.fail(f"{page}'s blocks failed (rc {result.returncode}):\n{result.stderr[-8000:]}", pytrace=False)
