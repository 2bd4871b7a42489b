"""The bench tests run as the runtimes' do (``tests/runtime/conftest.py``): in a temp working folder,
under the device double when ``STAGEHAND_TEST_LAG`` is set."""

from tests.runtime.conftest import _device_double, _in_tmp_dir  # noqa: F401
