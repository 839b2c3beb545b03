"""The zygote's report lines (realign/launch/forked_workers.parse_report): the launcher
reads only the protocol's lines and skips any other, so a blank or stray line on the
zygote's report pipe cannot stop the reader (a stopped reader would leave a run's
workers unpolled)."""
from __future__ import annotations

import pytest

from realign.launch.forked_workers import parse_report

pytestmark = pytest.mark.pure


def test_the_protocols_lines_are_read():
    assert parse_report(b"started 4242\n") == ("started", 4242, 0)
    assert parse_report(b"exit 4242 0\n") == ("exit", 4242, 0)
    assert parse_report(b"exit 4242 -9\n") == ("exit", 4242, -9)
    assert parse_report(b"exit 4242 1\n") == ("exit", 4242, 1)


@pytest.mark.parametrize("line", [b"\n", b"", b"   \n", b"ready\n", b"started\n",
                                  b"started x\n", b"exit 12\n", b"exit 12 x\n",
                                  b"Warning: something imported printed\n",
                                  b"\xff\xfe\n", b"started 1 2\n"])
def test_any_other_line_is_skipped(line):
    assert parse_report(line) is None
