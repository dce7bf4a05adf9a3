"""Print the project's requirements (pyproject's dependencies plus the named extras), one a
line, so the image can install them before the sources are copied: a source edit then
reuses the dependency layer instead of reinstalling everything.

    python deps.py pyproject.toml "[flashinfer]" > requirements.txt
"""

from __future__ import annotations

import sys

try:
    import tomllib
except ImportError:  # Python 3.10: pip vendors the same parser
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]


def requirements(pyproject: str, extras: str) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    wanted = [e.strip() for e in extras.strip("[] ").split(",") if e.strip()]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in wanted if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extras {unknown}; pyproject has {sorted(optional)}")
    out = list(project.get("dependencies", []))
    for extra in wanted:
        out += optional[extra]
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")))
