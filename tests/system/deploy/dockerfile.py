"""Just enough of the Dockerfile and .dockerignore formats to check them without Docker
(which cannot run on CI machines): instructions by stage, and the build-context filter."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import PurePosixPath


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, COPY, RUN, ...
    args: str  # the rest of the logical line, continuations joined
    stage: int  # index of the FROM it belongs to (-1 before the first FROM)
    line: int  # 1-based line where it starts

    def exec_form(self) -> list[str]:
        """JSON (exec) form as a list; shell form split like a shell would."""
        text = self.args.strip()
        if text.startswith("["):
            value = json.loads(text)
            assert isinstance(value, list)
            return [str(v) for v in value]
        return shlex.split(text)

    def flags_and_operands(self) -> tuple[dict[str, str], list[str]]:
        """``COPY --from=build --chown=1 a b dst`` -> ({from: build, chown: 1}, [a, b, dst])."""
        words = self.exec_form()
        flags = {}
        while words and words[0].startswith("--"):
            name, _, value = words.pop(0)[2:].partition("=")
            flags[name] = value
        return flags, words


def parse(text: str) -> list[Instruction]:
    instructions: list[Instruction] = []
    stage, pending, start = -1, "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):  # comments inside a continuation are dropped
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical = pending + line
        pending = ""
        keyword, _, args = logical.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(keyword, args.strip(), stage, start))
    assert not pending, "the Dockerfile ends inside a line continuation"
    return instructions


def _glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Go's filepath.Match plus ``**`` (any number of directories), as Docker uses them."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + "$")


@dataclass(frozen=True)
class DockerIgnore:
    rules: tuple[tuple[bool, re.Pattern[str]], ...]  # (is_exception, pattern)

    @classmethod
    def parse(cls, text: str) -> DockerIgnore:
        rules = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negated = line.startswith("!")
            pattern = str(PurePosixPath(line.lstrip("!").strip().lstrip("/")))
            rules.append((negated, _glob_to_regex(pattern)))
        return cls(tuple(rules))

    def included(self, path: str) -> bool:
        """Whether ``path`` (relative to the context) reaches the build. A pattern matching
        a directory matches everything under it; the last matching pattern wins."""
        parts = PurePosixPath(path).parts
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        excluded = False
        for negated, regex in self.rules:
            if any(regex.match(p) for p in prefixes):
                excluded = not negated
        return not excluded
