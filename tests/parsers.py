"""Walk an argparse parser and every subcommand parser under it (the CLI tests' helper)."""

from __future__ import annotations

import argparse


def all_parsers(ap: argparse.ArgumentParser):
    """``ap`` and every subcommand parser under it, depth first."""
    yield ap
    for act in ap._actions:
        if isinstance(act, argparse._SubParsersAction):
            for sub in act.choices.values():
                yield from all_parsers(sub)
