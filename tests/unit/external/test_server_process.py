import sys

import pytest

from llmc.core.errors import LlmcError
from llmc.external.server_process import free_port, served


def test_a_server_is_used_once_it_answers_and_stopped_on_the_way_out(tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    with served("http.server", command, {}, tmp_path / "log", f"http://127.0.0.1:{port}/", 30) as process:
        assert process.poll() is None
    assert process.poll() is not None


def test_a_server_that_exits_first_names_its_last_error_line(tmp_path):
    command = [sys.executable, "-c", "import sys; print('ValueError: first'); print('RuntimeError: bad flag'); sys.exit(2)"]
    with pytest.raises(LlmcError, match=r"exited with 2 before serving .*RuntimeError: bad flag"):
        with served("fake", command, {}, tmp_path / "log", f"http://127.0.0.1:{free_port()}/", 30):
            pass


def test_a_server_that_never_answers_is_stopped_after_the_timeout(tmp_path):
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(LlmcError, match="did not answer within 2 s"):
        with served("sleeper", command, {}, tmp_path / "log", f"http://127.0.0.1:{free_port()}/", 2):
            pass
