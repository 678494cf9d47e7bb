"""The warnings hetrain logs during a block: its logger does not propagate to the root logger, so pytest's
caplog sees none of them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def hetrain_warnings() -> Iterator[list[str]]:
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("hetrain")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
