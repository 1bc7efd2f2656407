import contextlib
import os
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no machine locks, so run the suite there without xdist
    fcntl = None

import pytest
import torch
import jaxtyping
from jaxtyping import install_import_hook

# The jaxtyping annotations on the readable core are checked (dtype kind, rank and named-dimension
# consistency within a call) on every call made by the tests, so a false shape annotation fails here
# instead of misleading a reader. This must run before glasslm's modules are first imported.
_SHAPE_CHECKED = ["glasslm.core.layers", "glasslm.core.positions", "glasslm.core.attention", "glasslm.core.model"]
install_import_hook(_SHAPE_CHECKED, "beartype.beartype")


# Long training loops call the same modules thousands of times with the same shapes; checking them
# there doubled those files' time and checks nothing the component tests do not.
_LOOP_TEST_FILES = {"test_learning", "test_train", "test_checkpoint", "test_quantize"}


@contextlib.contextmanager
def _shape_checks_off():
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


@pytest.fixture(autouse=True)
def _no_shape_checks_in_training_loops(request):
    if request.module.__name__.rsplit(".", 1)[-1] in _LOOP_TEST_FILES:
        with _shape_checks_off():
            yield
    else:
        yield


@pytest.fixture
def unchecked_shapes():
    """For tests that pass wrong shapes on purpose, to see glasslm's own error (what users get)."""
    with _shape_checks_off():
        yield

# Tests are small: more threads than cores only adds contention on the 2-core CI machines. Under
# pytest-xdist (scripts/test.sh runs two workers) each worker has a core of its own, so one thread;
# a test marked `alone` has the machine to itself and gets the serial run's threads back.
SERIAL_THREADS = min(2, os.cpu_count() or 1)
WORKER_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else SERIAL_THREADS
torch.set_num_threads(WORKER_THREADS)


def _machine_locks(config) -> tuple[Path, Path] | None:
    """(gate, run) lock files shared by this run's xdist workers; None outside xdist (or off POSIX)."""
    worker = getattr(config, "workerinput", None)
    if worker is None or fcntl is None:
        return None
    # Each worker's basetemp is a folder of the controller's (pytest-of-USER/pytest-N/popen-gwI), which
    # pytest prunes with the rest of the old runs' temporary folders.
    factory = getattr(config, "_tmp_path_factory", None)
    shared = factory.getbasetemp().parent if factory is not None else Path(tempfile.gettempdir())
    stem = shared / f"glasslm-machine-{worker['testrunuid']}"
    return stem.with_suffix(".gate"), stem.with_suffix(".run")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, a test marked `alone` (it measures time or load, or its processes need every core)
    waits until the other workers finish their current test and keeps them waiting until it is done:
    each test holds the run lock shared, an `alone` one exclusive. The gate keeps the shared holders
    from starving a waiting `alone` test: every test passes it before taking the run lock, and the
    `alone` one holds it while it waits and runs. Setup and teardown (module fixtures too) are inside."""
    locks = _machine_locks(item.config)
    if locks is None:
        return (yield)
    alone = item.get_closest_marker("alone") is not None
    with open(locks[0], "a+") as gate, open(locks[1], "a+") as run:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(run, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        torch.set_num_threads(SERIAL_THREADS if alone else WORKER_THREADS)
        try:
            return (yield)
        finally:
            torch.set_num_threads(WORKER_THREADS)
            fcntl.flock(run, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.fixture
def one_thread():
    """Tiny models on one thread: a second thread only waits for a core on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The shared test data directory ($GLASSLM_DATA_DIR; CI points it at ../shared/data)."""
    path = os.environ.get("GLASSLM_DATA_DIR")
    if not path or not Path(path).is_dir():
        pytest.skip("set GLASSLM_DATA_DIR to the shared data directory (tinyshakespeare.txt, gpt2/)")
    return Path(path)


@pytest.fixture(scope="session")
def shakespeare_text(data_dir) -> str:
    path = data_dir / "tinyshakespeare.txt"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path.read_text(encoding="utf-8")


CHAT_PROMPTS = ["", "hello there", [{"role": "user", "content": "hi"}]]


@pytest.fixture(scope="session")
def llama_chat(tmp_path_factory):
    """(directory, transformers model, transformers tokenizer) of a tiny Llama chat model saved by
    transformers, whose greedy decoding reaches an eos early from each of CHAT_PROMPTS (tests/chat_models.py)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from chat_models import llama_chat_dir

    return llama_chat_dir(tmp_path_factory.mktemp("llama-chat"), CHAT_PROMPTS)


@pytest.fixture(scope="session")
def padded_qwen3(tmp_path_factory, data_dir):
    """(directory, transformers model, transformers tokenizer) of a Qwen3 whose 50,304 embedding rows
    outnumber its GPT-2 tokenizer's 50,259 tokens, its padding rows the likeliest (tests/padded_models.py)."""
    import sys

    from glasslm.tokenizers import find_gpt2_files

    sys.path.insert(0, str(Path(__file__).parent))
    from padded_models import padded_qwen3_dir

    try:
        files = find_gpt2_files(data_dir)
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return padded_qwen3_dir(tmp_path_factory.mktemp("padded-qwen3"), files)


def pytest_terminal_summary(terminalreporter):
    """Says once which llama.cpp the reference tests ran and how (its extra buffer types are off where
    its build has AMX: benchmarks/llamacpp_reference.py), so a run on an AMX Xeon says so."""
    import importlib.util
    import sys

    if importlib.util.find_spec("llama_cpp") is None:
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from llamacpp_reference import configuration

    terminalreporter.write_line(f"reference: {configuration()}")
