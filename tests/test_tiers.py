"""The tier lists in tests/conftest.py name tests that exist (a renamed test would silently change its tier),
and the Makefile's inner loop skips only files whose every test is out of it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

TESTS = Path(__file__).parent


def _load_conftest():
    """tests/conftest.py by its path: the name ``conftest`` may be another folder's (tests/gpu/)."""
    spec = importlib.util.spec_from_file_location("tiers_of_the_suite", TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


conftest = _load_conftest()


def _listed() -> dict[str, list[str]]:
    """Every ``file.py::test`` the lists name, by the list."""
    return {
        "MAKE_TEST_CASES": list(conftest.MAKE_TEST_CASES),
        "INNER_LOOP_CASES": list(conftest.INNER_LOOP_CASES),
        "EXHAUSTIVE_TESTS": list(conftest.EXHAUSTIVE_TESTS),
        "SLOW_TESTS": [test for tests in conftest.SLOW_TESTS.values() for test in tests],
    }


def test_every_listed_test_is_defined_in_its_file():
    for name, keys in _listed().items():
        for key in keys:
            file, test = key.split("::")
            source = TESTS / file
            assert source.exists(), f"conftest.{name} names {key}: no file {file}"
            assert re.search(rf"^def {re.escape(test)}\(", source.read_text(), re.MULTILINE), (
                f"conftest.{name} names {key}: {file} defines no {test}"
            )


def test_a_test_has_one_tier_decision_and_cases_are_named():
    listed = _listed()
    slow, exhaustive = set(listed["SLOW_TESTS"]), set(listed["EXHAUSTIVE_TESTS"])
    assert not slow & exhaustive, f"both slow and exhaustive (exhaustive is also slow): {slow & exhaustive}"
    assert len(listed["SLOW_TESTS"]) == len(slow), "a test listed twice in SLOW_TESTS"
    for cases, whole in ((conftest.MAKE_TEST_CASES, exhaustive), (conftest.INNER_LOOP_CASES, slow | exhaustive)):
        for key, kept in cases.items():
            assert kept and key not in whole, f"{key}: keep at least one case, or list the whole test"
    for key, kept in conftest.INNER_LOOP_CASES.items():
        outside = set(kept) - set(conftest.MAKE_TEST_CASES.get(key, kept))
        assert not outside, f"{key}: inner-loop cases {outside} are not in make test"


def test_the_inner_loop_skips_only_files_marked_slow_whole():
    makefile = (TESTS.parent / "Makefile").read_text()
    skipped = re.search(r"^INNER_LOOP_SKIPS := .*?,(.*)\)$", makefile, re.MULTILINE)
    assert skipped, "the Makefile defines INNER_LOOP_SKIPS"
    for file in skipped.group(1).split():
        assert re.search(r"^pytestmark = pytest\.mark\.slow$", (TESTS / file).read_text(), re.MULTILINE), (
            f"make test-fast does not collect {file}, yet not every test there is marked slow"
        )
