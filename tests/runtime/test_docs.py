"""The runtime package's example (``runtime/stagehand/__init__.py``) runs as written."""

import doctest

import stagehand


def test_package_example_runs_as_a_doctest():
    result = doctest.testmod(stagehand, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert result.attempted >= 18  # the whole example ran, not a fragment
