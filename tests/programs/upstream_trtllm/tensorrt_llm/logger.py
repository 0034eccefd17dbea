"""Upstream's logger, reduced: ``[TRT-LLM] [I] ...`` lines on stderr at or above
``TLLM_LOG_LEVEL`` (default ``warning``)."""
import os
import sys

_LEVELS = {"verbose": 0, "debug": 0, "info": 1, "warning": 2, "error": 3}


class Logger:
    def _log(self, level, tag, msg):
        floor = _LEVELS.get(os.environ.get("TLLM_LOG_LEVEL", "warning").lower(), 2)
        if level >= floor:
            print(f"[TRT-LLM] [{tag}] {msg}", file=sys.stderr, flush=True)

    def debug(self, msg):
        self._log(0, "D", msg)

    def info(self, msg):
        self._log(1, "I", msg)

    def warning(self, msg):
        self._log(2, "W", msg)

    def error(self, msg):
        self._log(3, "E", msg)


logger = Logger()
