"""Row streams: packing, determinism, independence from the process layout, exact resume.

The source here is a plain list of {"text": bytes} records (grain takes any random-access
sequence, as it takes the array_record source in a run) and the tokenizer maps each byte to
one id, so every expectation below is computed directly from the documents.
"""

import numpy as np
import pytest

from moetext.data import pipeline

EOS, BOS = 1, 2


class ByteTokenizer:
    """id = byte + 3 (0 pad, 1 EOS, 2 BOS)."""

    vocab_size, pad_id, eos_id, bos_id = 259, 0, EOS, BOS

    def encode(self, text):
        return [b + 3 for b in text.encode()]


def _docs(n, seed=0):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "pi", "omega"]
    return [{"text": " ".join(rng.choice(words, rng.integers(1, 30))).encode()} for _ in range(n)]


def _packed(docs, rows, b=4, s=15, seed=0, shuffle=True):
    ds = pipeline.tokenized_documents(docs, ByteTokenizer(), seed=seed, shuffle=shuffle)
    return pipeline.PackedBatches(ds, rows=rows, global_batch_size=b, seq_len=s)


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_rows_are_the_stream_of_documents_with_segments_and_positions():
    docs, b, s = _docs(23), 4, 15
    batches = _take(_packed(docs, range(b), b, s, shuffle=False), 12)
    for r in range(b):
        tokens = np.concatenate([x["tokens"][r] for x in batches])
        seg = [x["segment_ids"][r] for x in batches]
        pos = np.concatenate([x["positions"][r] for x in batches])
        # Stream r holds documents r, r + b, ... (no shuffle), each [BOS] + bytes + [EOS].
        want = np.concatenate(
            [
                [BOS, *ByteTokenizer().encode(docs[j % 23]["text"].decode()), EOS]
                for j in range(r, r + 200 * b, b)
            ]
        )[: len(tokens)]
        np.testing.assert_array_equal(tokens, want)
        # Positions restart at each BOS and count on across row boundaries.
        starts = np.flatnonzero(tokens == BOS)
        for a, z in zip(starts, [*starts[1:], len(tokens)], strict=True):
            np.testing.assert_array_equal(pos[a:z], np.arange(z - a))
        for row_seg, row_tok in zip(seg, (x["tokens"][r] for x in batches), strict=True):
            # Segments number the documents of a row 1, 2, ...; a new one starts at each BOS
            # (or at the row start) and no token is padding.
            new = np.r_[True, row_tok[1:] == BOS]
            np.testing.assert_array_equal(row_seg, np.cumsum(new))
    assert all(x["tokens"].shape == (b, s + 1) for x in batches)


def test_every_document_once_per_epoch_reshuffled_per_epoch():
    docs = _docs(40)
    ds = pipeline.tokenized_documents(docs, ByteTokenizer(), seed=5, shuffle=True)
    order = [bytes((ds[k][1:-1] - 3).astype(np.uint8)) for k in range(80)]
    texts = sorted(d["text"] for d in docs)
    assert sorted(order[:40]) == texts and sorted(order[40:]) == texts
    assert order[:40] != order[40:]
    assert order[:40] != [d["text"] for d in docs]


def test_rows_do_not_depend_on_the_process_layout():
    docs = _docs(31)
    whole = _take(_packed(docs, range(4)), 6)
    halves = [_take(_packed(docs, rows), 6) for rows in ([0, 1], [2, 3])]
    odd = _take(_packed(docs, [3, 1]), 6)
    for n in range(6):
        for key in whole[n]:
            joined = np.concatenate([halves[0][n][key], halves[1][n][key]])
            np.testing.assert_array_equal(joined, whole[n][key])
            np.testing.assert_array_equal(odd[n][key], whole[n][key][[3, 1]])


def test_seed_changes_the_order_and_is_deterministic():
    docs = _docs(31)
    a, b, c = (_take(_packed(docs, range(4), seed=s), 3) for s in (1, 1, 2))
    assert all((x["tokens"] == y["tokens"]).all() for x, y in zip(a, b, strict=True))
    assert any((x["tokens"] != y["tokens"]).any() for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("prefetch", [None, 1, 3])
def test_state_resumes_exactly(prefetch):
    docs = _docs(17)
    make = lambda: _packed(docs, range(4), s=40)  # rows longer than most documents
    wrap = (lambda p: p) if prefetch is None else (lambda p: pipeline.Prefetcher(p, prefetch))
    straight_it = wrap(make())
    straight = _take(straight_it, 9)
    first = wrap(make())
    _take(first, 5)
    state = first.get_state()
    if prefetch is not None:
        first.close()
    resumed = wrap(make())
    resumed.set_state(state)
    for x, y in zip(straight[5:], _take(resumed, 4), strict=True):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
    for p in (straight_it, resumed):
        getattr(p, "close", lambda: None)()


def test_rows_longer_than_every_document_and_missing_state():
    docs = [{"text": b"ab"}, {"text": b"c"}]
    batch = next(_packed(docs, range(2), b=2, s=20, shuffle=False))
    assert batch["segment_ids"][0].max() > 4  # many documents in one row
    with pytest.raises(ValueError, match="no position for rows"):
        _packed(docs, [0, 1], b=2).set_state({"0": [0, 0]})


def test_empty_split_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        pipeline.tokenized_documents([], ByteTokenizer(), seed=0, shuffle=True)
