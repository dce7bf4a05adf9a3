"""The executor's kernel switches (``ExecutorConfig.fuse_decode_rope``, ``.pdl``) as
benchmark flags, so one tree can be A/B-timed against itself with a switch flipped; and
``--merge-decode-splits``, the Triton backend's class-wide choice of who merges the
decode splits (``TritonBackend.merge_splits``), which is not a config field."""

from __future__ import annotations

import argparse

from executor.config import KERNEL_SWITCH_MODES

SWITCHES = ("fuse_decode_rope", "pdl")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``--fuse-decode-rope`` and ``--pdl``, each ``auto``/``on``/``off``; left out, the
    config's default."""
    for name in SWITCHES:
        ap.add_argument("--" + name.replace("_", "-"), choices=KERNEL_SWITCH_MODES,
                        default=None, help=f"ExecutorConfig.{name} (default: the config's)")


    ap.add_argument("--merge-decode-splits", choices=("on", "off"), default=None,
                    help="on: the split kernel's last program merges the decode splits; "
                    "off: a second launch does (default: TritonBackend.merge_splits)")


def apply(args: argparse.Namespace) -> None:
    """Set what ``--merge-decode-splits`` asked for, before any backend is built."""
    if args.merge_decode_splits is not None:
        from executor.attention.triton_backend import TritonBackend

        TritonBackend.merge_splits = args.merge_decode_splits == "on"


def overrides(args: argparse.Namespace) -> dict[str, str]:
    """The switches given on the command line, as ``ExecutorConfig`` keyword arguments."""
    return {name: getattr(args, name) for name in SWITCHES if getattr(args, name) is not None}
