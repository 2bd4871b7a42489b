"""The application's tests run as the runtimes' do (``tests/stagehand/conftest.py``): in a temp
working folder, under a lagging device when ``STAGEHAND_TEST_LAG`` is set."""

from tests.stagehand.conftest import _in_tmp_dir, _lagging_device  # noqa: F401
