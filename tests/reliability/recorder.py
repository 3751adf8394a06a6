"""Reliability and security suites against real engine processes (tests/engine_fixture.py). Every test records what
it tried in the session's `recorder`; `pytest tests/reliability` ends with the table of fault kinds and cases tried,
cases the engine (and the client or node) survived, results lost (jobs that did not end with exactly one result or
error at the client that asked, which must stay 0), and, for cases that name their engine, the engine's peak RSS
(VmHWM) and its open file descriptors after the case (the most over the suite's cases).

A plugin (tests/conftest.py names it) rather than this folder's conftest: under pytest-xdist the controller, which
collects nothing, prints the table from the tallies each worker hands over when it finishes."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field

import pytest

from .helpers import open_fds, peak_rss_bytes


@dataclass
class Tally:
    tried: int = 0
    survived: int = 0
    lost: int = 0
    kinds: set[str] = field(default_factory=set)
    peak_rss: int = 0  # bytes
    fds_after: int = 0

    def add(self, other: "Tally") -> None:
        self.tried, self.survived, self.lost = (self.tried + other.tried, self.survived + other.survived,
                                                self.lost + other.lost)
        self.kinds |= other.kinds
        self.peak_rss, self.fds_after = max(self.peak_rss, other.peak_rss), max(self.fds_after, other.fds_after)


@dataclass
class Recorder:
    tallies: dict[str, Tally] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def case(self, suite: str, kind: str | None = None, engine=None):
        """One case of `suite` (of fault `kind`, default the suite's name): tried on entry, survived when the block
        ends without an exception; with `engine` (a RunningEngine) its peak RSS and open descriptors are read
        after the block."""
        tally = self.tallies.setdefault(suite, Tally())
        tally.tried += 1
        tally.kinds.add(kind or suite)
        yield
        tally.survived += 1
        if engine is not None and engine.process.poll() is None:
            self.measured(suite, engine.process.pid)

    def measured(self, suite: str, pid: int) -> None:
        tally = self.tallies.setdefault(suite, Tally())
        tally.peak_rss = max(tally.peak_rss, peak_rss_bytes(pid))
        tally.fds_after = max(tally.fds_after, open_fds(pid))

    def lost(self, suite: str, count: int) -> None:
        self.tallies.setdefault(suite, Tally()).lost += count

    def note(self, line: str) -> None:
        self.notes.append(line)

    def as_dict(self) -> dict:
        return {"tallies": {suite: {**asdict(t), "kinds": sorted(t.kinds)} for suite, t in self.tallies.items()},
                "notes": list(self.notes)}

    def merge(self, other: dict) -> None:
        """Add a worker's `as_dict` to this tally."""
        for suite, t in other["tallies"].items():
            self.tallies.setdefault(suite, Tally()).add(Tally(**{**t, "kinds": set(t["kinds"])}))
        self.notes += other["notes"]


RECORDER = pytest.StashKey[Recorder]()


def pytest_configure(config):
    config.stash[RECORDER] = Recorder()


@pytest.fixture(scope="session")
def recorder(pytestconfig) -> Recorder:
    return pytestconfig.stash[RECORDER]


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)  # set on a pytest-xdist worker
    if workeroutput is not None:
        workeroutput["reliability"] = session.config.stash[RECORDER].as_dict()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: a worker finished; add its tally."""
    tally = getattr(node, "workeroutput", {}).get("reliability")
    if tally:
        node.config.stash[RECORDER].merge(tally)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    recorder = config.stash.get(RECORDER, None)
    if recorder is None or not recorder.tallies:
        return
    write = terminalreporter.write_line
    terminalreporter.write_sep("=", "reliability summary")
    def row(name, tally, kinds):
        rss = f"{tally.peak_rss / 2**20:.0f} MB" if tally.peak_rss else "-"
        fds = str(tally.fds_after) if tally.fds_after else "-"
        write(f"{name:<14}{kinds:>7}{tally.tried:>13}{tally.survived:>10}{tally.lost:>14}{rss:>18}{fds:>11}")

    write(f"{'suite':<14}{'kinds':>7}{'cases tried':>13}{'survived':>10}{'results lost':>14}{'peak engine RSS':>18}"
          f"{'fds after':>11}")
    total = Tally()
    for suite, tally in recorder.tallies.items():
        row(suite, tally, len(tally.kinds))
        total.add(tally)
    row("total", total, sum(len(t.kinds) for t in recorder.tallies.values()))
    for line in recorder.notes:
        write(line)
