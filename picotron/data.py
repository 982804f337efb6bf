"""Data: from text to the (input, target) batches one rank trains on.

The whole path, one line each::

    text (str)           load_text("shakespeare"): 42 plays and poems, 5 MB, shipped xz-compressed (picotron.text)
    -> token ids         ByteTokenizer: the UTF-8 bytes themselves, so vocab_size = 256 and no files
    -> 1-D LongTensor    TokenData: the corpus as one long tensor; the last 5 % is the validation split
    -> windows           a window is seq_len + 1 consecutive tokens starting at a random offset
    -> (input, target)   input = window[:-1], target = window[1:]: predict every next token

A byte tokenizer makes the model see characters: it must learn spelling before words, the embedding
table stays tiny, and a small model soon writes text shaped like a play. ``get_tokenizer("HuggingFaceTB/...")``
swaps in a real BPE tokenizer (needs ``transformers``) when you want realistic vocabularies.

Batches are a pure function of (seed, step, micro_step, dp_rank). Nothing is iterated, nothing is
stateful: step k's batch is the same whether or not steps 0..k-1 were drawn, so resuming from a
checkpoint only needs the step number, and changing the layout never changes which data is seen.

Row order. For each optimizer step we draw ALL ``G = dp_size * grad_acc * micro_batch_size`` offsets
at once from a generator seeded by (seed, step) and lay them out rank-major::

    global row = (dp_rank * grad_acc + micro_step) * micro_batch_size + i

so data-parallel rank r owns the r-th contiguous block of G / dp_size rows, and its micro-steps walk
through that block. With the global batch G fixed, the SET of rows in one step is the same for every
(dp_size, grad_acc, micro_batch_size); with micro_batch_size also fixed, even the micro-batches are
the same tensors, merely handed to other (rank, micro-step) slots: dp=2 x grad_acc=1 trains on
exactly the batches dp=1 x grad_acc=2 does. That is what makes the data-parallel parity tests possible.

Context parallelism slices each row along the sequence: every cp rank of a dp group draws the same rows (cp
does not enter the offsets) and keeps the columns at its ``positions`` (``context_parallel.positions``: two
chunks of 2·cp), which travel with the batch so that RoPE sees each token's true position.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from picotron.text import CORPUS, DataError, check_size, load_text  # noqa: F401 (the text: no torch)


# --------------------------------------------------------------------------- tokenizers
class ByteTokenizer:
    """Token id = UTF-8 byte value. No vocabulary file, nothing to train, 256 ids."""
    vocab_size = 256
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, errors: str = "replace") -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return bytes(ids).decode("utf-8", errors=errors)

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Fast path: view the bytes as uint8 (no Python loop), widen to int64."""
        raw = bytearray(text.encode("utf-8"))
        if not raw:  # frombuffer refuses empty buffers
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(raw, dtype=torch.uint8).long()


class HFTokenizer:
    """Adapter giving a ``transformers`` tokenizer the ByteTokenizer interface."""

    def __init__(self, name: str):
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ImportError(f"tokenizer {name!r} needs the 'transformers' package: pip install "
                              "transformers (or use tokenizer='byte')") from e
        self.name = name
        looks_like_path = name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.path.exists(name)
        try:  # a local folder or the Hugging Face cache first: no network, no retries
            self.tok = AutoTokenizer.from_pretrained(os.path.expanduser(name), local_files_only=True)
        except Exception as e:
            if looks_like_path:
                what = f"holds no tokenizer transformers can read ({_first_line(e)})" if os.path.exists(
                    os.path.expanduser(name)) else "is not an existing folder"
                raise DataError(f"tokenizer={name!r} {what}; pass --tokenizer byte (the default) or the folder of a "
                                f"Hugging Face tokenizer.") from None
            why = _hub_unreachable()
            if why:
                raise DataError(f"tokenizer={name!r} is not a local folder or in the Hugging Face cache, and the Hub "
                                f"cannot be reached ({why}); pass --tokenizer byte (the default) or the folder of a "
                                f"tokenizer.") from None
            try:
                self.tok = AutoTokenizer.from_pretrained(name)  # a Hub name: needs the network once
            except Exception as e:
                raise DataError(f"tokenizer={name!r} could not be loaded from the Hugging Face Hub ({_first_line(e)}); "
                                f"check the name, or pass --tokenizer byte (the default) or the folder of a "
                                f"tokenizer.") from None
        self.vocab_size = len(self.tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False, verbose=False)["input_ids"])

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])

    def encode_tensor(self, text: str) -> torch.Tensor:
        return torch.tensor(self.encode(text), dtype=torch.long)


def _first_line(e, limit=160):
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__


def _hub_unreachable(timeout_s: float = 3.0):
    """Why the Hugging Face Hub cannot be reached (a few words), or None. A quick look first: offline, the
    Hub client retries for about a minute before it gives up."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return "HF_HUB_OFFLINE is set"
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
    except OSError as e:
        return f"no connection to {host}: {e.strerror or e}"
    return None


def printable(tokenizer, ids) -> str:
    """Decode generated ids for a terminal: bytes that are not UTF-8 and control characters (an untrained
    model emits many; ESC or BEL would act on the terminal) are shown as \\xNN escapes; newlines and tabs stay."""
    text = tokenizer.decode(ids, errors="backslashreplace") if isinstance(tokenizer, ByteTokenizer) else \
        tokenizer.decode(ids)
    return "".join(c if c in "\n\t" or (c.isprintable() and c != "\ufffd") else
                   c.encode("unicode_escape").decode("ascii") for c in text)


def get_tokenizer(name: str = "byte"):
    """``"byte"`` -> ByteTokenizer; anything else is a local path or Hub name for AutoTokenizer."""
    return ByteTokenizer() if name == "byte" else HFTokenizer(name)


# --------------------------------------------------------------------------- token data
class TokenData:
    """The tokenised corpus as one 1-D int64 tensor, split into train (first 95 %) and val (last 5 %).

    The split is by position, so the two never share a token; ``train`` and ``val`` are views.
    """

    def __init__(self, tokens: torch.Tensor, vocab_size: int = 256, val_fraction: float = 0.05):
        assert tokens.dim() == 1 and tokens.dtype == torch.long, "tokens must be a 1-D LongTensor"
        self.tokens, self.vocab_size = tokens, vocab_size
        n_val = int(len(tokens) * val_fraction)
        self.train, self.val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]

    @classmethod
    def load(cls, source: str = "shakespeare", tokenizer: str = "byte", val_fraction: float = 0.05):
        tok = get_tokenizer(tokenizer)
        return cls(tok.encode_tensor(load_text(source)), tok.vocab_size, val_fraction)

    def __repr__(self):
        return (f"TokenData({len(self.tokens):,} tokens: train {len(self.train):,}, "
                f"val {len(self.val):,}, vocab {self.vocab_size})")


# --------------------------------------------------------------------------- batches
def _windows(tokens: torch.Tensor, offsets: torch.Tensor, seq_len: int):
    """Gather rows tokens[o : o + seq_len + 1] and split them into (input, target)."""
    rows = tokens[offsets[:, None] + torch.arange(seq_len + 1)]
    return rows[:, :-1], rows[:, 1:]


def step_offsets(n_tokens: int, step: int, *, seq_len: int, global_batch: int, seed: int):
    """Start offsets of all ``global_batch`` windows of one optimizer step, in global row order."""
    if n_tokens < seq_len + 1:
        raise ValueError(f"{n_tokens} tokens are too few for one window of seq_len+1={seq_len + 1}; "
                         "use a shorter seq_len or more text")
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**63)  # stable (seed, step) mix
    return torch.randint(0, n_tokens - seq_len, (global_batch,), generator=g)


def get_batch(tokens: torch.Tensor, step: int, micro_step: int, *, seq_len: int,
              micro_batch_size: int, grad_acc: int = 1, dp_size: int = 1, dp_rank: int = 0,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's micro-batch ``micro_step`` of optimizer step ``step``: (input, target), each
    [micro_batch_size, seq_len] int64 on the CPU, target = input shifted left by one token.

    Row order (see the module docstring): global row = (dp_rank * grad_acc + micro_step) * b + i.
    """
    if not (0 <= micro_step < grad_acc and 0 <= dp_rank < dp_size):
        raise ValueError(f"micro_step={micro_step} must be in [0, {grad_acc}) and dp_rank={dp_rank} "
                         f"in [0, {dp_size})")
    b = micro_batch_size
    offsets = step_offsets(len(tokens), step, seq_len=seq_len, global_batch=dp_size * grad_acc * b,
                           seed=seed)
    first = (dp_rank * grad_acc + micro_step) * b
    return _windows(tokens, offsets[first: first + b], seq_len)


def val_offsets(n_tokens: int, n_rows: int, seq_len: int) -> torch.Tensor:
    """``n_rows`` evenly spaced window offsets covering the validation split: no randomness at all."""
    if n_tokens < seq_len + 1:
        raise ValueError(f"validation split has {n_tokens} tokens, too few for seq_len={seq_len}")
    return torch.linspace(0, n_tokens - seq_len - 1, n_rows, dtype=torch.float64).long()


class Batch(NamedTuple):
    """One micro-batch: inputs and targets [b, s] (targets = inputs shifted by one token) and the position of
    each input token [s]. Positions travel with every batch: a strategy that cuts the sequence (context
    parallelism) hands each rank its tokens with their true positions, which RoPE needs."""
    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor


class DataLoader:
    """The settings of one rank, bundled: ``.batch(step, micro_step)``, ``.micro_batches(step)`` (what the
    step engine runs) and ``.val_batches(n)``."""

    def __init__(self, data: TokenData, *, seq_len: int, micro_batch_size: int, grad_acc: int = 1,
                 dp_size: int = 1, dp_rank: int = 0, seed: int = 0, positions: torch.Tensor | None = None):
        self.data, self.seq_len, self.micro_batch_size = data, seq_len, micro_batch_size
        self.grad_acc, self.dp_size, self.dp_rank, self.seed = grad_acc, dp_size, dp_rank, seed
        # the token positions this rank keeps of every row (context parallelism), in its order; default all
        self.positions = torch.arange(seq_len) if positions is None else positions.long()

    def _keep(self, x, y):
        if len(self.positions) == self.seq_len and bool((self.positions == torch.arange(self.seq_len)).all()):
            return Batch(x, y, self.positions)
        return Batch(x[:, self.positions], y[:, self.positions], self.positions)

    @property
    def global_batch(self) -> int:
        """Windows per optimizer step over all dp ranks (tokens per step = this * seq_len)."""
        return self.dp_size * self.grad_acc * self.micro_batch_size

    def batch(self, step: int, micro_step: int = 0):
        return get_batch(self.data.train, step, micro_step, seq_len=self.seq_len,
                         micro_batch_size=self.micro_batch_size, grad_acc=self.grad_acc,
                         dp_size=self.dp_size, dp_rank=self.dp_rank, seed=self.seed)

    def micro_batches(self, step: int):
        """This rank's grad_acc micro-batches of optimizer step `step`, as `Batch`es (its tokens of each row)."""
        return [self._keep(*self.batch(step, k)) for k in range(self.grad_acc)]

    def val_batches(self, n: int):
        """Yield ``n`` fixed validation `Batch`es of [micro_batch_size, seq_len] rows, the same rows on every rank
        and for every layout (a trainer may still split them over dp ranks and average); each rank gets its
        tokens of them, as in training."""
        b = self.micro_batch_size
        offsets = val_offsets(len(self.data.val), n * b, self.seq_len)
        for k in range(n):
            yield self._keep(*_windows(self.data.val, offsets[k * b: (k + 1) * b], self.seq_len))
