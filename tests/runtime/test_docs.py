"""The runtime package's example (``runtime/__init__.py``) runs as written."""

import doctest

import runtime


def test_package_example_runs_as_a_doctest():
    result = doctest.testmod(runtime, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert result.attempted >= 18  # the whole example ran, not a fragment
