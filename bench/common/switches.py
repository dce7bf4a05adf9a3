"""The executor's kernel switches (``ExecutorConfig.fuse_decode_rope``, ``.pdl``,
``.skinny_row_kernel``, ``.fp8_glu``) as benchmark flags, so one tree can be A/B-timed
against itself with a switch flipped."""

from __future__ import annotations

import argparse

from executor import config

# An executor older than the switches has none: the flags then still parse, and none may be
# given.
KERNEL_SWITCH_MODES: tuple[str, ...] = getattr(config, "KERNEL_SWITCH_MODES", ("auto", "on", "off"))
SWITCHES = ("fuse_decode_rope", "pdl", "skinny_row_kernel", "fp8_glu")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``--fuse-decode-rope``, ``--pdl``, ``--skinny-row-kernel`` and ``--fp8-glu``, each
    ``auto``/``on``/``off``; left out, the config's default."""
    for name in SWITCHES:
        ap.add_argument("--" + name.replace("_", "-"), choices=KERNEL_SWITCH_MODES,
                        default=None, help=f"ExecutorConfig.{name} (default: the config's)")


def overrides(args: argparse.Namespace) -> dict[str, str]:
    """The switches given on the command line, as ``ExecutorConfig`` keyword arguments."""
    return {name: getattr(args, name) for name in SWITCHES if getattr(args, name) is not None}
