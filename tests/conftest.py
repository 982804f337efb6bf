"""Shared test set-up: make `import picotron` work without `pip install -e .`.

Multi-rank tests use `picotron.launch.run_on_ranks`; the functions they run on each rank must live at
module level in a test file (children import them by name), and the children inherit this sys.path.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
