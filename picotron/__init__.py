"""picotron: distributed LLM training from scratch, one short module and one lesson per strategy.

Start with `picotron.model` (a Llama that knows nothing about parallelism), `picotron.train` (the loop)
and `lessons/01_single_device/01_single_device.ipynb`.
"""
__version__ = "0.1.0"
