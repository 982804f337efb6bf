"""Importing this module does once what every training process does first, for a parent whose workers fork from
it: the test suite's fork server imports it (tests/conftest.py, PICOTRON_PRELOAD; picotron.launch preloads
torch._dynamo for everyone), so each of its rank processes starts warm instead of paying for itself:

- the CPU's fp32 matmul peak for the MFU column (picotron.metrics.measured_matmul_peak, 0.5 s on this 2-core
  machine), measured on one thread, as a rank process runs, before the workers load the cores;
- the embedded corpus, decompressed (picotron.text, 0.1 s);
- gc.freeze(), last: what the parent holds by then (torch, picotron) moves to the collector's permanent generation,
  so a worker's full collection (Mesh.destroy runs one) walks only its own objects: 0.2 s a process otherwise.
  Python's documentation suggests it before forking (https://docs.python.org/3/library/gc.html#gc.freeze).

Preload this module last. All of it is caching: nothing a run computes changes. Nothing here starts a thread, so forking after it is safe.
"""
import gc

import torch

from picotron import metrics, text

torch.set_num_threads(1)  # what every rank process runs on (picotron.launch); no thread pool to lose in a fork
metrics.measured_matmul_peak(torch.device("cpu"), torch.float32)
text.load_text()
gc.freeze()
