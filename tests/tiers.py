"""Test tiers from measurements: which tests are ``slow`` and which start processes (``multiprocess``).

``make test-tiers`` runs the whole suite once with ``FP8LM_RECORD_TIERS=tests/tiers.json``: this plugin times every
test (setup, call and teardown) and every fixture whose scope is wider than a test, and notes which of them started
a process (``subprocess``, ``multiprocessing``, ``torch.multiprocessing``: torchrun, spawned gloo ranks, scripts).
``tests/conftest.py`` reads the file and marks each collected test:

- ``multiprocess``: it, or a module/session fixture it uses, started a process;
- ``slow``: it took :data:`SLOW_S` seconds or more, or a wider fixture it uses did.

``make test-fast`` deselects both (and ``gpu``). A test the file does not know yet (new since the last recording) is
in the fast tier until the next ``make test-tiers``.
"""

from __future__ import annotations

import json
import multiprocessing.process
import subprocess
import time
from pathlib import Path

import pytest

SLOW_S = 2.0
"""Seconds from which a test (or a wider fixture's set-up) counts as slow."""


def load(path: Path) -> dict:
    """The recorded tiers (``{"tests": {nodeid: {"s", "spawns"}}, "fixtures": {name@baseid: {"s", "spawns"}}}``), or
    empty ones when nothing was recorded."""
    if not path.is_file():
        return {"tests": {}, "fixtures": {}}
    return json.loads(path.read_text())


def marks(item: pytest.Item, tiers: dict) -> list[str]:
    """The tier markers of ``item`` from ``tiers``."""
    out = set()
    test = tiers["tests"].get(item.nodeid)
    if test is not None:
        if test["spawns"]:
            out.add("multiprocess")
        if test["s"] >= SLOW_S:
            out.add("slow")
    for name in getattr(item, "fixturenames", ()):
        for key, fixture in tiers["fixtures"].items():
            fixture_name, baseid = key.split("@", 1)
            if fixture_name == name and item.nodeid.startswith(baseid):
                if fixture["spawns"]:
                    out.add("multiprocess")
                if fixture["s"] >= SLOW_S:
                    out.add("slow")
    return sorted(out)


class Recorder:
    """The plugin ``FP8LM_RECORD_TIERS`` installs (module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tests: dict[str, dict] = {}
        self.fixtures: dict[str, dict] = {}
        self.spawned = 0
        self._popen_init = subprocess.Popen.__init__
        self._process_start = multiprocessing.process.BaseProcess.start

    def install(self) -> None:
        recorder = self

        def popen_init(popen, *args, **kwargs):
            recorder.spawned += 1
            return recorder._popen_init(popen, *args, **kwargs)

        def process_start(process):
            recorder.spawned += 1
            return recorder._process_start(process)

        subprocess.Popen.__init__ = popen_init
        multiprocessing.process.BaseProcess.start = process_start

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        if fixturedef.scope == "function":
            yield
            return
        start, spawned = time.perf_counter(), self.spawned
        yield
        key = f"{fixturedef.argname}@{fixturedef.baseid}"
        entry = self.fixtures.setdefault(key, {"s": 0.0, "spawns": False})
        entry["s"] = max(entry["s"], round(time.perf_counter() - start, 3))
        entry["spawns"] |= self.spawned > spawned

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        start, spawned = time.perf_counter(), self.spawned
        yield
        self.tests[item.nodeid] = {"s": round(time.perf_counter() - start, 3), "spawns": self.spawned > spawned}

    def pytest_sessionfinish(self, session):
        # a wider fixture's set-up is its own entry: the test that happened to trigger it keeps only its own cost
        self.path.write_text(json.dumps({"slow_s": SLOW_S, "tests": dict(sorted(self.tests.items())),
                                         "fixtures": dict(sorted(self.fixtures.items()))}, indent=0) + "\n")
