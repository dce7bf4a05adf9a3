"""Just enough PromQL lexing to list the metrics and labels a query uses.

Not a parser: promtool checks syntax (tests/system/deploy/test_alerts.py and test_grafana.py);
this only finds names, so a dashboard or alert cannot refer to a metric or label the
service does not export. String literals (label values, Grafana's ``$instance``) and
range selectors (``[5m]``, ``[$__rate_interval]``) are dropped first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_RANGE = re.compile(r"\[[^\]]*\]")
_TOKEN = re.compile(
    r"(?P<number>(?:\d+(?:ms|[smhdwy]))+|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)"
    r"|(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)"
    r"|(?P<punct>=~|!~|!=|==|>=|<=|[{}(),=<>+\-*/%^])"
    r"|(?P<space>\s+)"
    r"|(?P<other>.)"
)
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"bool", "and", "or", "unless", "offset", "inf", "nan", "atan2"})
# Aggregation operators may be followed by a grouping clause instead of "(".
AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
                          "count_values", "bottomk", "topk", "quantile", "limitk",
                          "limit_ratio"})
MATCH_OPS = frozenset({"=", "!=", "=~", "!~"})


@dataclass
class Usage:
    """What one expression refers to."""

    metrics: set[str] = field(default_factory=set)
    # metric -> label names its selector matches on
    matchers: dict[str, set[str]] = field(default_factory=dict)
    # label names in by / without / on / ignoring / group_left / group_right clauses
    grouping: set[str] = field(default_factory=set)


def _tokens(expr: str) -> list[tuple[str, str]]:
    text = _RANGE.sub(" ", _STRING.sub('""', expr))
    out = []
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup or "other"
        if kind != "space":
            out.append((kind, m.group()))
    return out


def _label_list(tokens: list[tuple[str, str]], start: int) -> tuple[list[str], int]:
    """Identifiers of a parenthesised list starting at ``tokens[start] == '('``."""
    names, i = [], start + 1
    while i < len(tokens) and tokens[i][1] != ")":
        if tokens[i][0] == "ident":
            names.append(tokens[i][1])
        i += 1
    return names, i + 1


def _matchers(tokens: list[tuple[str, str]], start: int) -> tuple[list[str], int]:
    """Label names of a ``{...}`` block starting at ``tokens[start] == '{'``."""
    names, i = [], start + 1
    while i < len(tokens) and tokens[i][1] != "}":
        if (tokens[i][0] == "ident" and i + 1 < len(tokens)
                and tokens[i + 1][1] in MATCH_OPS):
            names.append(tokens[i][1])
        i += 1
    return names, i + 1


def usage(expr: str) -> Usage:
    tokens = _tokens(expr)
    result = Usage()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "ident" and text in GROUPING and following == "(":
            names, i = _label_list(tokens, i + 1)
            result.grouping.update(names)
            continue
        if (kind == "ident" and following != "("
                and text not in KEYWORDS | GROUPING | AGGREGATIONS):
            result.metrics.add(text)
            labels = result.matchers.setdefault(text, set())
            if following == "{":
                names, i = _matchers(tokens, i + 1)
                labels.update(names)
                continue
        elif kind == "punct" and text == "{":  # a selector with no metric name
            names, i = _matchers(tokens, i)
            result.matchers.setdefault("", set()).update(names)
            continue
        i += 1
    return result
