"""transformers' load report, held back while the engine loads a model and replaced by what happened: HF
reports weights it did not place itself (a declared MLP head's `score.0.*`, a head's `score.bias`, a TRL
value head) as UNEXPECTED and the linear head it built instead as MISSING and "newly initialized", the
opposite of what the engine then does with them. A load that fails gets HF's report as it was."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

# transformers' loading logger (modeling_utils passes it to utils/loading_report.log_state_dict_report).
HF_LOADING_LOGGER = "transformers.modeling_utils"
REPORT_MARK = "LOAD REPORT"  # in the report's first line, "<Class> LOAD REPORT from: <path>"


class _HeldReport(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if REPORT_MARK in str(record.msg):
            self.records.append(record)
            return False
        return True


@contextlib.contextmanager
def held_load_report() -> Iterator[None]:
    """Hold transformers' load report back inside; a load that raises logs it after all, as it was."""
    held = _HeldReport()
    logger = logging.getLogger(HF_LOADING_LOGGER)
    logger.addFilter(held)
    try:
        yield
    except BaseException:
        logger.removeFilter(held)
        for record in held.records:
            logger.handle(record)
        raise
    finally:
        logger.removeFilter(held)


def report_unused(model_dir: Path, unexpected: Iterable[str], placed: Iterable[str]) -> None:
    """Say which checkpoint weights the model leaves out: the `unexpected` ones outside the modules the
    engine `placed` itself (an `lm_head` beside a classifier's head: harmless, the scores do not read it)."""
    prefixes = tuple(f"{name}." for name in placed)
    unused = sorted(key for key in unexpected if not key.startswith(prefixes))
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        log.info("%s: the checkpoint's %s are not part of the model and are left out", model_dir.name, shown)
