"""The training text, before any tokenizer: `load_text` (the embedded corpus, a local .txt file or folder, or a
Hugging Face dataset) and `check_size` (enough tokens for one window in each split), with `DataError`'s one sentence.

No torch here: `picotron.rules` reads a local file and refuses a wrong one before torch loads (a second, not the
seconds torch takes). `picotron.data` imports these names and goes on from text to tokens and batches.
"""
from __future__ import annotations

import functools
import lzma
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus" / "shakespeare.txt.xz"


class DataError(ValueError):
    """The data or the tokenizer cannot be used; the message is one sentence: what, why, a fix."""


@functools.lru_cache(maxsize=1)
def _shakespeare() -> str:
    """Decompress the embedded corpus once per process (~0.1 s)."""
    return lzma.decompress(CORPUS.read_bytes()).decode("utf-8")


def load_text(source: str = "shakespeare", *, split: str = "train", text_field: str = "text",
              **hf_kwargs) -> str:
    """Return a training text.

    ``"shakespeare"``: the embedded corpus (see picotron/corpus/NOTICE).
    A path: a ``.txt`` file, or a directory whose ``*.txt`` files are joined in sorted order.
    ``"hf:<dataset>[:<config>]"``: a Hugging Face dataset (needs ``datasets``); the ``text_field``
    column of ``split`` is joined with newlines; extra keywords go to ``datasets.load_dataset``
    (e.g. ``load_text("hf:text", data_files="my.txt")``).
    """
    if source == "shakespeare":
        return _shakespeare()
    if source.startswith("hf:"):
        try:
            import datasets
        except ImportError as e:
            raise ImportError(f"data source {source!r} needs the 'datasets' package: pip install "
                              "datasets (or use a local .txt file)") from e
        name, _, config = source[3:].partition(":")
        ds = datasets.load_dataset(name, config or None, split=split, **hf_kwargs)
        return "\n".join(ds[text_field])
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise DataError(f"data folder {source!r} holds no *.txt file; put the training text in .txt files "
                            f"there or pass --data FILE.txt.")
        return "\n\n".join(_read_text(f) for f in files)
    if path.is_file():
        return _read_text(path)
    raise DataError(f"data={source!r} is neither 'shakespeare', an existing .txt file or folder, nor "
                    f"'hf:<dataset>[:<config>]'; pass --data shakespeare or the path of a text file.")


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {str(path)!r} is not UTF-8 text (byte {e.start} is {raw[e.start]:#04x}; a "
                        f"binary file?); pass a text file, or convert it first (iconv -t UTF-8).") from None


def check_size(source: str, n_tokens: int, seq_len: int, val_fraction: float = 0.05):
    """Raise DataError unless both splits of `n_tokens` tokens hold one window of seq_len + 1 tokens."""
    if n_tokens == 0:
        raise DataError(f"data {source!r} is empty (no text at all); pass a file with some text, or --data "
                        f"shakespeare.")
    n_val = int(n_tokens * val_fraction)
    if min(n_tokens - n_val, n_val) < seq_len + 1:  # the validation split is the last 5 %: it needs a window too
        need = (seq_len + 1) * int(round(1 / val_fraction)) + 1
        shorter = f"pass --seq-len {n_val - 1} or less, or " if n_val >= 2 else "pass "  # 1 token needs 2
        raise DataError(f"data {source!r} holds {n_tokens:,} tokens, too few for seq_len={seq_len}: its validation "
                        f"split (the last {val_fraction:.0%}, {n_val:,} tokens) needs one window of seq_len+1; "
                        f"{shorter}at least {need:,} tokens of text.")
