"""Reliability and security suites against real engine processes (tests/engine_fixture.py). Every test records what
it tried in the session's `recorder`; `pytest tests/reliability` ends with the table of cases tried, cases the engine
(and the client or node) survived, and results lost (jobs that did not end with exactly one result or error at the
client that asked, which must stay 0)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pytest


@dataclass
class Tally:
    tried: int = 0
    survived: int = 0
    lost: int = 0


@dataclass
class Recorder:
    tallies: dict[str, Tally] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def case(self, suite: str):
        """One case of `suite`: tried on entry, survived when the block ends without an exception."""
        tally = self.tallies.setdefault(suite, Tally())
        tally.tried += 1
        yield
        tally.survived += 1

    def lost(self, suite: str, count: int) -> None:
        self.tallies.setdefault(suite, Tally()).lost += count

    def note(self, line: str) -> None:
        self.notes.append(line)


RECORDER = pytest.StashKey[Recorder]()


def pytest_configure(config):
    config.stash[RECORDER] = Recorder()


@pytest.fixture(scope="session")
def recorder(pytestconfig) -> Recorder:
    return pytestconfig.stash[RECORDER]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    recorder = config.stash.get(RECORDER, None)
    if recorder is None or not recorder.tallies:
        return
    write = terminalreporter.write_line
    terminalreporter.write_sep("=", "reliability summary")
    write(f"{'suite':<12}{'cases tried':>14}{'survived':>12}{'results lost':>15}")
    total = Tally()
    for suite, tally in recorder.tallies.items():
        write(f"{suite:<12}{tally.tried:>14}{tally.survived:>12}{tally.lost:>15}")
        total.tried, total.survived, total.lost = (total.tried + tally.tried, total.survived + tally.survived,
                                                   total.lost + tally.lost)
    write(f"{'total':<12}{total.tried:>14}{total.survived:>12}{total.lost:>15}")
    for line in recorder.notes:
        write(line)
