"""picotron: distributed LLM training from scratch, one short module and one lesson per strategy.

Start with `picotron.model` (a Llama that knows nothing about parallelism), `picotron.train` (the loop)
and `lessons/01_single_device/01_single_device.ipynb`.
"""
from picotron.compat import require_torch as _require_torch

_require_torch()  # a torch older than the floor (picotron/compat.py) is refused here, in one sentence
__version__ = "0.1.0"
