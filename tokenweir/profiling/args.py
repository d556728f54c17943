"""The flags of `tokenweir profile` beyond the engine's; torch-free, so that building the CLI
(and running `tokenweir simulate`) needs no torch."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, required=True, help="where to write the profile JSON")
    parser.add_argument("--grid", choices=("full", "quick"), default="full",
                        help="quick: a small grid for a first look (a less exact fit)")
    parser.add_argument("--serving-threads", action=argparse.BooleanOptionalAction, default=False,
                        help="engine grid only: run steps with the thread choice of `tokenweir serve "
                             "--engine-in-process` (one thread fewer for small steps); `serve`'s engine "
                             "process keeps torch's default, as the grid does without this flag")
    parser.add_argument("--serving", action="store_true",
                        help="profile `tokenweir serve` itself: start it with --step-trace, load it "
                             "with streaming clients, and fit to the engine loop's real step times")
