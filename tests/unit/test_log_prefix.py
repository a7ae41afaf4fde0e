"""The package's log lines carry ``tiacc_training: `` once, under any handler."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from tiacc_training.torch.distributed import _state

LOGGER = logging.getLogger("tiacc_training")


@pytest.fixture
def alone() -> Iterator[logging.Logger]:
    """The package's logger with no handlers of its own and not propagating."""
    saved = (LOGGER.handlers[:], LOGGER.propagate, LOGGER.level)
    LOGGER.handlers, LOGGER.propagate = [], False
    LOGGER.setLevel(logging.INFO)
    try:
        yield LOGGER
    finally:
        LOGGER.handlers, LOGGER.propagate = saved[0], saved[1]
        LOGGER.setLevel(saved[2])


def said(logger: logging.Logger, *formats: tuple[str, str]) -> list[str]:
    """What one INFO line looks like through handlers of ``(format, style)``."""
    streams = []
    for fmt, style in formats:
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter(fmt, style=style))  # type: ignore[arg-type]
        logger.addHandler(handler)
        streams.append(stream)
    logger.info("DDP through the engine (%d buckets)", 3)
    return [s.getvalue().rstrip("\n") for s in streams]


def test_a_message_only_handler_gets_the_prefix(alone: logging.Logger) -> None:
    assert said(alone, ("%(message)s", "%")) == [
        "tiacc_training: DDP through the engine (3 buckets)"
    ]


@pytest.mark.parametrize(
    ("fmt", "style"),
    [
        ("%(levelname)s:%(name)s:%(message)s", "%"),
        ("{name}: {message}", "{"),
        ("$name $message", "$"),
    ],
)
def test_handlers_that_show_the_name_do_not_get_it_twice(
    alone: logging.Logger, fmt: str, style: str
) -> None:
    (line,) = said(alone, (fmt, style))
    assert line.count("tiacc_training") == 1, line


def test_one_handler_without_the_name_puts_the_prefix_in_every_line(
    alone: logging.Logger,
) -> None:
    lines = said(alone, ("%(name)s: %(message)s", "%"), ("%(message)s", "%"))
    assert lines[1] == "tiacc_training: DDP through the engine (3 buckets)", lines
    assert lines[0].startswith("tiacc_training: "), lines


def test_no_handler_at_all_means_logging_s_last_resort_which_shows_the_message_alone(
    alone: logging.Logger,
) -> None:
    alone.handlers = []  # pytest also attaches its capture to non-propagating loggers
    record = alone.makeRecord(alone.name, logging.WARNING, __file__, 1, "slow", (), None)
    assert _state._Prefixed().filter(record) and record.msg == "tiacc_training: slow"
    # Filtered twice (a second logger call with the same record): once.
    assert _state._Prefixed().filter(record) and record.msg == "tiacc_training: slow"


def test_the_handlers_a_record_reaches_follow_propagation(alone: logging.Logger) -> None:
    root = logging.getLogger()
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    try:
        assert handler not in _state._reached(alone)
        alone.propagate = True
        assert handler in _state._reached(alone)
    finally:
        root.removeHandler(handler)
