"""The application's tests run as the runtimes' do (``tests/stagehand/conftest.py``): in a temp
working folder, under the device double when ``STAGEHAND_TEST_LAG`` is set."""

from tests.stagehand.conftest import _device_double, _in_tmp_dir  # noqa: F401
