"""The executor's kernel switches (``ExecutorConfig.fuse_decode_rope``, ``.pdl``,
``.weight_prefetch``) as benchmark flags, so one tree can be A/B-timed against itself with
a switch flipped."""

from __future__ import annotations

import argparse
from typing import Any

from executor.config import KERNEL_SWITCH_MODES

SWITCHES = ("fuse_decode_rope", "pdl", "weight_prefetch")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``--fuse-decode-rope``, ``--pdl`` and ``--weight-prefetch``, each
    ``auto``/``on``/``off``, and ``--weight-prefetch-mib``; left out, the config's default."""
    for name in SWITCHES:
        ap.add_argument("--" + name.replace("_", "-"), choices=KERNEL_SWITCH_MODES,
                        default=None, help=f"ExecutorConfig.{name} (default: the config's)")
    ap.add_argument("--weight-prefetch-mib", type=float, default=None,
                    help="ExecutorConfig.weight_prefetch_mib (default: the config's)")


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The switches given on the command line, as ``ExecutorConfig`` keyword arguments."""
    given: dict[str, Any] = {name: getattr(args, name) for name in SWITCHES
                                if getattr(args, name) is not None}
    if getattr(args, "weight_prefetch_mib", None) is not None:
        given["weight_prefetch_mib"] = args.weight_prefetch_mib
    return given
