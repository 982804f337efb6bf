"""Shared test set-up: make `import picotron` work without `pip install -e .`.

Multi-rank tests use `picotron.launch.run_on_ranks`; the functions they run on each rank must live at
module level in a test file (children import them by name), and the children inherit this sys.path.
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture
def run_notebook(monkeypatch):
    """Execute lessons/<name>/<name>.ipynb top to bottom in FAST mode (in its folder, as Jupyter does); return
    the text its code cells printed."""
    import nbclient  # in requirements.txt: a missing package must fail the test, not skip it
    import nbformat

    def run(name, timeout=300):
        monkeypatch.setenv("PICOTRON_FAST", "1")
        folder = os.path.join(ROOT, "lessons", name)
        nb = nbformat.read(os.path.join(folder, f"{name}.ipynb"), as_version=4)
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": folder}}).execute()
        return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)

    return run


# The whole parity matrix (tests/test_parity_matrix.py) is opt-in: its covering subset runs by default.
MATRIX_FLAG = "--parity-matrix"


# Heavier cases of a few matrices (more processes, the same code paths as a default case) are opt-in too, so the
# default suite stays near 30 minutes on a 2-core machine: `--heavy` runs them (`--heavy --parity-matrix`: everything).
HEAVY_FLAG = "--heavy"


def pytest_addoption(parser):
    parser.addoption(HEAVY_FLAG, action="store_true", default=False,
                     help="also run the heavier cases marked `heavy` (8-process collectives, every schedule at pp = 4, "
                          "every ring-attention variant at every cp, three more checkpoint reshard pairs), whose code paths the "
                          "default cases cover")
    parser.addoption(MATRIX_FLAG, action="store_true", default=False,
                     help="run every variant of tests/test_parity_matrix.py (dp, pp, cp, tp in {1, 2}, sp, ZeRO-1, "
                          "ep on the MoE preset; up to 16 processes), not only its default covering subset")


def pytest_configure(config):
    config.addinivalue_line("markers", f"heavy: a heavier case whose code paths a default case covers; runs with "
                                       f"{HEAVY_FLAG}")
    config.addinivalue_line("markers", f"parity_matrix: a parity-matrix variant outside the default subset; runs "
                                       f"with {MATRIX_FLAG}")


def pytest_collection_modifyitems(config, items):
    heavy = pytest.mark.skip(reason=f"a heavier case, covered by the default ones; runs with {HEAVY_FLAG}")
    matrix = pytest.mark.skip(reason=f"the whole parity matrix runs with {MATRIX_FLAG} "
                                     f"(python -m pytest tests/test_parity_matrix.py {MATRIX_FLAG})")
    for item in items:
        if item.get_closest_marker("heavy") and not config.getoption(HEAVY_FLAG):
            item.add_marker(heavy)
        if item.get_closest_marker("parity_matrix") and not config.getoption(MATRIX_FLAG):
            item.add_marker(matrix)
