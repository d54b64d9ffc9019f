"""transformers' logging as hp-rewrite uses it: silencing it, its progress bar and loggers, its loading
report, errors cut to one line.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings and progress bars (config validation chatter, shard bars)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def progress_bar(items, desc: str, shown: bool = True):
    """``items`` under transformers' progress bar (off where transformers' bars are off), shown or not."""
    from transformers.utils import logging as hf_logging

    return hf_logging.tqdm(items, desc=desc, disable=not shown)


def transformers_logger(module: str):
    """The logger of ``transformers.<module>``, to report what transformers reports there, as it does."""
    from transformers.utils import logging as hf_logging

    return hf_logging.get_logger(f"transformers.{module}")


def short_error(e: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, cut to ``limit`` characters (transformers errors can be long)."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def log_loading_report(model, name_or_path, info) -> None:
    """transformers' LOAD REPORT of ``from_pretrained`` (missing, unexpected, mismatched keys), as it logs it."""
    from transformers.utils.loading_report import log_state_dict_report

    log_state_dict_report(model=model, pretrained_model_name_or_path=str(name_or_path), ignore_mismatched_sizes=False,
                          loading_info=info, logger=transformers_logger("modeling_utils"))
