"""The README's two scheduler loops ("Driving it from a scheduler"), run as written against
a live server: the pipelined Session loop gives the unary loop's tokens, and both leave
the KV cache as they found it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tests.service.harness import ServerHarness

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_loops() -> dict[str, Any]:
    text = README.read_text()
    section = text.split("## Driving it from a scheduler", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the section has no Python block"
    namespace: dict[str, Any] = {}
    exec(compile(code.group(1), "README.md", "exec"), namespace)
    return namespace


def test_the_readme_loops_give_the_same_tokens(server: ServerHarness) -> None:
    loops = readme_loops()
    before = server.kv()
    prompt = [5, 17, 99, 3, 250, 41]
    unary = loops["generate"](server.stub, "readme-unary", prompt, 24)
    for depth in (1, 2, 3):
        piped = loops["generate_pipelined"](server.stub, f"readme-piped-{depth}", prompt, 24,
                                            depth)
        assert piped == unary
    assert len(unary) == 24
    assert server.kv() == before
