"""Tests for picotron/data.py and the embedded corpus."""
import hashlib
import re
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
import torch

from picotron import data
from picotron.data import ByteTokenizer, DataError, DataLoader, TokenData, get_batch, get_tokenizer, load_text


@pytest.fixture(scope="module")
def corpus() -> TokenData:
    return TokenData.load("shakespeare")


def rows_of(x: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(r.tolist()) for r in x]


# --------------------------------------------------------------------------- corpus
def test_corpus_is_shakespeare():
    text = load_text("shakespeare")
    assert len(text) > 5_000_000 and text.isascii()
    for line in ["To be, or not to be,--that is the question:--", "ROMEO AND JULIET",
                 "Shall I compare thee to a summer's day?", "THE TEMPEST", "Now is the winter of our discontent"]:
        assert line in text
    assert text.count("by William Shakespeare") == 42  # one per work
    assert "\r" not in text
    assert load_text() is text  # decompressed once per process


def test_no_gutenberg_boilerplate_left():
    text = load_text("shakespeare")
    for marker in ["Gutenberg", "GUTENBERG", "eBook", "EBOOK", "Etext", "ETEXT", "*** ",
                   "END OF", "SMALL PRINT", "Copyright", "COPYRIGHT", "LICENSE", "public domain",
                   "PUBLIC DOMAIN", "www.", "http", "Michael S. Hart", "trademark", "WARRANTIES"]:
        assert marker not in text, marker
    assert not re.search(r"\be-?text|[\w.]+@\w+\.\w+", text)  # no "etext", no e-mail addresses


def test_notice_matches_corpus():
    notice = (Path(data.__file__).parent / "corpus" / "NOTICE").read_text()
    sha = hashlib.sha256(load_text().encode()).hexdigest()
    assert sha in notice and "Project Gutenberg" in notice and "shakespeare" in notice
    assert len(re.findall(r" <- http", notice)) == 42


# --------------------------------------------------------------------------- tokenizers and sources
def test_byte_tokenizer_round_trip():
    tok = get_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    for s in ["", "To be, or not to be", "naïve café — ☃ 𝄞\n\ttabs"]:
        ids = tok.encode(s)
        assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == s
        assert tok.encode_tensor(s).tolist() == ids and tok.encode_tensor(s).dtype == torch.long
    assert tok.decode(torch.tensor([72, 105, 0xFF])) == "Hi\ufffd"  # invalid UTF-8 is replaced


def test_hf_tokenizer_from_local_directory(tmp_path):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0, "to": 1, "be": 2, "or": 3, "not": 4, ",": 5}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]").save_pretrained(tmp_path)
    tok = get_tokenizer(str(tmp_path))
    assert tok.vocab_size == 6 and tok.encode("to be, or not to be") == [1, 2, 5, 3, 4, 1, 2]
    assert tok.encode_tensor("to be").tolist() == [1, 2]
    assert "not" in tok.decode([4])


def test_optional_packages_give_clear_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # simulate "not installed"
    with pytest.raises(ImportError, match="needs the 'transformers' package"):
        get_tokenizer("gpt2")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="needs the 'datasets' package"):
        load_text("hf:tiny_shakespeare")


def test_hf_dataset_text_loader(tmp_path, monkeypatch):
    """`hf:<name>[:<config>]` goes through datasets.load_dataset. With the real package installed we load
    a local file with its "text" builder; without it, a stand-in module checks what we ask it for."""
    (tmp_path / "a.txt").write_text("first line\nsecond line\n")
    try:
        import datasets  # noqa: F401
    except ImportError:
        calls = []

        def load_dataset(name, config, split, **kw):
            calls.append((name, config, split, kw))
            return {"text": ["first line", "second line"]}

        monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
        assert load_text("hf:text:cfg", data_files="a.txt") == "first line\nsecond line"
        assert calls == [("text", "cfg", "train", {"data_files": "a.txt"})]
        return
    assert load_text("hf:text", data_files=str(tmp_path / "a.txt"),
                     cache_dir=str(tmp_path / "cache")) == "first line\nsecond line"


def test_local_file_and_directory(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "skip.md").write_text("not text")
    assert load_text(str(tmp_path / "a.txt")) == "first"
    assert load_text(str(tmp_path)) == "first\n\nsecond"
    with pytest.raises(DataError, match="neither"):
        load_text(str(tmp_path / "missing.txt"))
    d = TokenData.load(str(tmp_path / "a.txt"))
    assert d.tokens.tolist() == list(b"first") and d.vocab_size == 256


# --------------------------------------------------------------------------- batches
KW = dict(seq_len=64, micro_batch_size=4, grad_acc=2, dp_size=2, seed=3)


def test_targets_are_inputs_shifted_by_one(corpus):
    x, y = get_batch(corpus.train, 0, 1, dp_rank=1, **KW)
    assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    # each row is the window at its documented global row: (dp_rank * grad_acc + micro_step) * b + i
    offsets = data.step_offsets(len(corpus.train), 0, seq_len=64, global_batch=16, seed=3)
    for i in range(4):
        o = offsets[(1 * 2 + 1) * 4 + i]
        assert torch.equal(x[i], corpus.train[o: o + 64]) and torch.equal(y[i], corpus.train[o + 1: o + 65])


def test_batches_are_deterministic(corpus):
    a = get_batch(corpus.train, 7, 1, dp_rank=0, **KW)
    torch.manual_seed(1234)  # the global RNG must not matter
    b = get_batch(corpus.train, 7, 1, dp_rank=0, **KW)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[0], get_batch(corpus.train, 8, 1, dp_rank=0, **KW)[0])
    assert not torch.equal(a[0], get_batch(corpus.train, 7, 1, dp_rank=0, **{**KW, "seed": 4})[0])


def test_resume_gives_the_same_batch(corpus):
    loader = DataLoader(corpus, **KW, dp_rank=1)
    for step in range(5):  # a run that drew steps 0..4
        for m in range(2):
            loader.batch(step, m)
    after_run = loader.batch(5, 1)
    fresh = DataLoader(corpus, **KW, dp_rank=1).batch(5, 1)  # a run resumed at step 5
    assert torch.equal(after_run[0], fresh[0]) and torch.equal(after_run[1], fresh[1])


LAYOUTS = [(1, 4, 4), (2, 2, 4), (4, 1, 4), (2, 1, 8), (1, 1, 16), (4, 2, 2), (1, 8, 2)]  # (dp, ga, b)


def test_rows_of_a_step_do_not_depend_on_layout(corpus):
    def step_rows(dp, ga, b, step=11):
        return Counter(r for rank in range(dp) for m in range(ga) for r in rows_of(
            get_batch(corpus.train, step, m, seq_len=32, micro_batch_size=b, grad_acc=ga, dp_size=dp,
                      dp_rank=rank, seed=0)[0]))
    reference = step_rows(*LAYOUTS[0])
    assert sum(reference.values()) == 16
    for layout in LAYOUTS[1:]:
        assert step_rows(*layout) == reference, layout


def test_same_micro_batches_when_dp_times_grad_acc_is_fixed(corpus):
    # dp=1 x grad_acc=4 trains on exactly the micro-batches that dp=4 x grad_acc=1 (or 2 x 2) does.
    def micro_batches(dp, ga):
        return sorted(rows_of(get_batch(corpus.train, 2, m, seq_len=16, micro_batch_size=3, grad_acc=ga,
                                        dp_size=dp, dp_rank=r, seed=1)[0])
                      for r in range(dp) for m in range(ga))
    assert micro_batches(1, 4) == micro_batches(2, 2) == micro_batches(4, 1)


def test_train_and_val_are_disjoint(corpus):
    n = len(corpus.tokens)
    assert len(corpus.val) == int(n * 0.05) and len(corpus.train) + len(corpus.val) == n
    assert torch.equal(torch.cat([corpus.train, corpus.val]), corpus.tokens)
    seq_len = 256
    offsets = torch.cat([data.step_offsets(len(corpus.train), s, seq_len=seq_len, global_batch=512, seed=0)
                         for s in range(20)])
    assert offsets.min() >= 0 and offsets.max() + seq_len + 1 <= len(corpus.train)  # never reach val
    assert offsets.max() > len(corpus.train) - 50_000  # ...but do reach its end
    loader = DataLoader(corpus, seq_len=seq_len, micro_batch_size=8)
    val_text = ByteTokenizer().decode(corpus.val)
    for x, y, _ in loader.val_batches(3):
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert all(ByteTokenizer().decode(r) in val_text for r in x)


def test_val_batches_are_fixed_and_layout_independent(corpus):
    a = list(DataLoader(corpus, seq_len=32, micro_batch_size=4, seed=0).val_batches(5))
    b = list(DataLoader(corpus, seq_len=32, micro_batch_size=4, grad_acc=2, dp_size=4, dp_rank=3,
                        seed=9).val_batches(5))
    assert len(a) == 5 and all(torch.equal(u[0], v[0]) and torch.equal(u[1], v[1]) for u, v in zip(a, b))
    assert len({r for x, _, _ in a for r in rows_of(x)}) == 20  # distinct, spread over the split


def test_bad_arguments_are_rejected(corpus):
    with pytest.raises(ValueError, match="micro_step=2"):
        get_batch(corpus.train, 0, 2, seq_len=8, micro_batch_size=2, grad_acc=2)
    with pytest.raises(ValueError, match="dp_rank=2"):
        get_batch(corpus.train, 0, 0, seq_len=8, micro_batch_size=2, dp_size=2, dp_rank=2)
    with pytest.raises(ValueError, match="too few"):
        get_batch(torch.arange(5), 0, 0, seq_len=8, micro_batch_size=2)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_context_parallel_ranks_hold_their_tokens_of_the_same_rows(corpus, layout):
    """Each cp rank gets the same rows, keeps its two chunks of every one, with their true positions; the pieces
    put back together are the whole batch (training and validation)."""
    from picotron import context_parallel as cpm
    whole = DataLoader(corpus, seq_len=32, micro_batch_size=2, grad_acc=2)
    for cp in (2, 4):
        ranks = [DataLoader(corpus, seq_len=32, micro_batch_size=2, grad_acc=2,
                            positions=cpm.positions(32, cp, r, layout)) for r in range(cp)]
        for k, full in enumerate(whole.micro_batches(3)):
            pieces = [loader.micro_batches(3)[k] for loader in ranks]
            assert all(p.inputs.shape == (2, 32 // cp) for p in pieces)
            assert torch.equal(cpm.unsplit([p.inputs for p in pieces], layout), full.inputs)
            assert torch.equal(cpm.unsplit([p.targets for p in pieces], layout), full.targets)
            assert torch.equal(torch.sort(torch.cat([p.positions for p in pieces])).values, torch.arange(32))
            for p in pieces:  # a token's position is its column in the full row
                assert torch.equal(full.inputs[:, p.positions], p.inputs)
        val = [list(loader.val_batches(2)) for loader in ranks]
        for k, full in enumerate(whole.val_batches(2)):
            assert torch.equal(cpm.unsplit([v[k].inputs for v in val], layout), full.inputs)
