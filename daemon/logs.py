"""Logging: one line per event; systemd level prefixes (<3>, <4>, <6>, <7>) when stderr is the journal."""

from __future__ import annotations

import logging
import os
import sys

_SYSLOG_PREFIX = {logging.DEBUG: "<7>", logging.INFO: "<6>", logging.WARNING: "<4>", logging.ERROR: "<3>",
                  logging.CRITICAL: "<2>"}


class JournalFormatter(logging.Formatter):
    """The journal adds its own timestamps; it reads the level from a ``<N>`` prefix."""

    def format(self, record: logging.LogRecord) -> str:
        return _SYSLOG_PREFIX.get(record.levelno, "<6>") + super().format(record)


def stderr_is_journal() -> bool:
    stream = os.environ.get("JOURNAL_STREAM")
    if not stream:
        return False
    try:
        dev, ino = (int(x) for x in stream.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if stderr_is_journal():
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
