"""The console handler of wfdash's log lines (settings.LOGGING)."""

from __future__ import annotations

import logging


class ConsoleHandler(logging.StreamHandler):
    """Writes to stderr unless the root logger has a handler: the record propagates to that
    one and is written there, once. daphne's command line gives the root logger a handler
    (logging.basicConfig) before Django configures logging; runserver and runworker leave
    it without one, so there this handler writes each line."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        super().emit(record)
