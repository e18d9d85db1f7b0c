"""Data generators: determinism by seed, labels against independent evaluators, splits."""

import random

import pytest
import torch

from effattn.tools.tasks import charlm, listops, synthetic
from effattn.tools.tasks.data import make_task, score, stream_seed

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- ListOps
@pytest.mark.parametrize(
    "text, value",
    [
        ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),  # the example of the LRA paper
        ("[MIN 3 [MAX 5 6 ] 8 ]", 3),
        ("[MED 1 9 4 ]", 4),
        ("[MED 1 2 3 9 ]", 2),  # even count: floor of the mean of the two middle values
        ("[MED 8 9 ]", 8),
        ("[SM 9 8 7 ]", 4),
        ("[SM [MAX 9 9 ] [SM 5 5 ] 1 ]", 0),
        ("7", 7),
    ],
)
def test_listops_evaluator_on_hand_examples(text, value):
    assert listops.evaluate(text.split()) == value


@pytest.mark.parametrize("text", ["[MAX 2 9", "[MAX 2 ]", "2 3", "]", "[FOO 1 2 ]", ""])
def test_listops_evaluator_rejects_malformed(text):
    with pytest.raises(ValueError, match="ListOps"):
        listops.evaluate(text.split())


def test_listops_labels_match_independent_evaluator():
    rng = random.Random(7)
    ops_seen = set()
    for _ in range(300):
        tokens, value = listops.sample_expression(rng, min_len=10, max_len=120)
        assert 10 <= len(tokens) <= 120
        assert listops.evaluate(tokens) == value
        ops_seen.update(t for t in tokens if t in listops.OPERATORS)
    assert ops_seen == set(listops.OPERATORS)


def test_listops_generate_is_deterministic_and_encoded():
    x, y = listops.generate(40, seed=3, min_len=16, max_len=64)
    x2, y2 = listops.generate(40, seed=3, min_len=16, max_len=64)
    x3, _ = listops.generate(40, seed=4, min_len=16, max_len=64)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, x3)
    assert x.shape == (40, 64) and x.dtype == torch.long
    lengths = (x != 0).sum(1)
    assert bool(((lengths >= 16) & (lengths <= 64)).all())
    for row, label in zip(x, y, strict=True):
        tokens = listops.decode(row.tolist())
        assert listops.evaluate(tokens) == int(label)
        # Padding only at the end.
        assert bool((row[len(tokens):] == 0).all())


def test_listops_long_sequences_and_depth():
    x, y = listops.generate(3, seed=0, min_len=500, max_len=2000)
    lengths = (x != 0).sum(1)
    assert x.shape[1] == 2000 and bool((lengths >= 500).all())
    for row, label in zip(x, y, strict=True):
        assert listops.evaluate(listops.decode(row.tolist())) == int(label)


def test_listops_bad_lengths():
    with pytest.raises(ValueError, match="min_len"):
        listops.sample_expression(random.Random(0), 50, 10)
    with pytest.raises(ValueError, match="between"):
        listops.sample_expression(random.Random(0), 2, 3)
    with pytest.raises(ValueError, match="does not fit"):
        listops.encode(["1"] * 5, 4)


# ---------------------------------------------------------------- recall and copy
def _recall_answers(row):
    """Independent reading of a recall sequence: a key seen before is a query; its answer is the
    value stored with it."""
    tokens = row.tolist()
    memory, answers = {}, {}
    for i in range(0, len(tokens) - 1, 2):
        key, value = tokens[i], tokens[i + 1]
        if key == 0:
            break
        if key in memory:
            answers[i] = memory[key]
        else:
            memory[key] = value
    return answers


def test_associative_recall_targets_are_the_paired_values():
    x, y = synthetic.associative_recall(20, seed=1, seq_len=64, vocab=32)
    assert x.shape == y.shape == (20, 64)
    for row, target in zip(x, y, strict=True):
        answers = _recall_answers(row)
        scored = {i: int(t) for i, t in enumerate(target) if t != synthetic.IGNORE}
        assert scored == answers
        assert len(scored) == 16
        keys = row[0:32:2]
        assert len(set(keys.tolist())) == 16 and int(keys.min()) >= 1 and int(keys.max()) <= 32
        assert int(row[1:32:2].min()) > 32


# MQAR (task recall): an independent reading of each sequence.
def _mqar_check(row, target, pairs, vocab):
    tokens, scored = row.tolist(), target.tolist()
    half = vocab // 2
    keys, values = tokens[0:2 * pairs:2], tokens[1:2 * pairs:2]
    # Keys and values from disjoint halves of the vocabulary (0 is padding), each distinct.
    assert all(1 <= k < half for k in keys) and all(half <= v < vocab for v in values)
    assert len(set(keys)) == pairs and len(set(values)) == pairs
    stored = dict(zip(keys, values, strict=True))
    asked = []
    for i in range(2 * pairs, len(tokens)):
        if scored[i] != synthetic.IGNORE:
            # A query: an even offset after the pairs, a key seen before; the target is its
            # value, which is no input (padding follows).
            assert (i - 2 * pairs) % 2 == 0
            assert tokens[i] in stored and tokens.index(tokens[i]) < 2 * pairs
            assert scored[i] == stored[tokens[i]] and tokens[i + 1] == 0
            asked.append(tokens[i])
        else:
            assert tokens[i] == 0  # padding between the queries
    assert sorted(asked) == sorted(keys)  # every key queried once
    # The loss sees the answers alone: nothing scored among the pairs.
    assert all(t == synthetic.IGNORE for t in scored[:2 * pairs])
    return asked


def test_mqar_layout():
    x, y = synthetic.mqar(50, seed=3, seq_len=128, num_pairs=16, vocab=256)
    assert x.shape == y.shape == (50, 128) and x.dtype == y.dtype == torch.long
    for row, target in zip(x, y, strict=True):
        _mqar_check(row, target, 16, 256)
    assert int((y != synthetic.IGNORE).sum()) == 50 * 16
    # The queries' places and order vary (not a positional shortcut).
    first = [int((t != synthetic.IGNORE).nonzero()[0]) for t in y]
    assert len(set(first)) > 3
    x, y = synthetic.mqar(20, seed=4, seq_len=40, num_pairs=8, vocab=300)
    for row, target in zip(x, y, strict=True):
        _mqar_check(row, target, 8, 300)
    x, _ = synthetic.mqar(4, seed=0, seq_len=24)  # default pairs: min(8, seq_len // 4)
    assert int((x[:, :12:2] > 0).sum()) == 24 and x.max() < 256


def test_mqar_deterministic_and_bad_args():
    a = synthetic.mqar(8, seed=5, seq_len=64)
    b = synthetic.mqar(8, seed=5, seq_len=64)
    c = synthetic.mqar(8, seed=6, seq_len=64)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])
    with pytest.raises(ValueError, match="no room"):
        synthetic.mqar(1, seed=0, seq_len=60, num_pairs=16)
    with pytest.raises(ValueError, match="vocab"):
        synthetic.mqar(1, seed=0, seq_len=128, num_pairs=32, vocab=64)


def test_recall_task_splits_and_recall_small():
    task = make_task("recall", 64, seed=0)
    assert task.vocab_size == 256 and task.info["num_pairs"] == 8
    vx, tx = task.eval_sets["valid"][0], task.eval_sets["test"][0]
    assert vx.shape == (256, 64) and tx.shape == (1024, 64)
    batch = task.train_batch(0, 8)
    assert torch.equal(batch[0], make_task("recall", 64, seed=0).train_batch(0, 8)[0])
    # Train, valid and test are different streams.
    assert not torch.equal(vx[:8], tx[:8]) and not torch.equal(batch[0], tx[:8])
    small = make_task("recall", 64, seed=0, num_pairs=12, vocab=512)
    assert small.vocab_size == 512 and int((small.eval_sets["test"][1] >= 0).sum(1)[0]) == 12
    # The earlier task, under its own name, with the held-out sets it had as recall.
    old = make_task("recall-small", 64, seed=0)
    assert old.vocab_size == 33 and old.info == {"vocab": 16}
    expect = synthetic.associative_recall(1024, seed=stream_seed(0, "recall", "test"),
                                          seq_len=64, vocab=16)
    assert all(torch.equal(u, v) for u, v in zip(old.eval_sets["test"], expect, strict=True))


def test_copy_targets_are_the_first_half():
    x, y = synthetic.copy_task(10, seed=2, seq_len=21, vocab=8)
    for row, target in zip(x, y, strict=True):
        first = row[:10]
        assert int(row[10]) == 1
        assert torch.equal(target[10:20], first)
        assert torch.equal(row[11:21], first)
        assert bool((target[:10] == synthetic.IGNORE).all()) and int(target[20]) == -100


def test_synthetic_deterministic_and_bad_args():
    for fn in (synthetic.associative_recall, synthetic.copy_task):
        a = fn(4, seed=5, seq_len=32)
        b = fn(4, seed=5, seq_len=32)
        c = fn(4, seed=6, seq_len=32)
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
        assert not torch.equal(a[0], c[0])
    with pytest.raises(ValueError, match="vocab"):
        synthetic.associative_recall(1, seed=0, seq_len=400, vocab=64)
    with pytest.raises(ValueError, match="no room"):
        synthetic.associative_recall(1, seed=0, seq_len=3)
    with pytest.raises(ValueError, match="too short"):
        synthetic.copy_task(1, seed=0, seq_len=2)


# ---------------------------------------------------------------- character LM
@pytest.fixture(scope="module")
def corpus():
    return charlm.Corpus.stdlib()


def test_corpus_splits_by_file(corpus):
    files = charlm.stdlib_files()
    assert len(files) > 100
    assert all(not charlm.SKIP_DIRS.intersection(p.parts[-4:-1]) for p in files)
    sizes = {s: len(corpus.split(s)) for s in charlm.SPLITS}
    total = sum(sizes.values())
    assert 0.8 < sizes["train"] / total < 0.97
    assert sizes["valid"] > 50_000 and sizes["test"] > 50_000
    texts = charlm.read_splits()
    headers = {s: {line for line in texts[s].splitlines() if line.startswith("# file: ")}
               for s in charlm.SPLITS}
    assert not headers["train"] & headers["test"] and not headers["valid"] & headers["test"]
    assert corpus.decode(corpus.split("test")[:len(texts["test"][:200])]) == texts["test"][:200]
    assert corpus.vocab == "".join(sorted(set(corpus.vocab)))
    assert int(corpus.split("train").max()) < corpus.vocab_size


def test_corpus_is_reproducible(corpus):
    again = charlm.Corpus.stdlib()
    assert again.sha256 == corpus.sha256 and again.vocab == corpus.vocab
    assert torch.equal(again.split("valid"), corpus.split("valid"))


def test_windows(corpus):
    data = corpus.split("valid")
    x, y = charlm.random_windows(data, 4, 32, torch.Generator().manual_seed(0))
    x2, _ = charlm.random_windows(data, 4, 32, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2) and x.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    tx, ty = charlm.tiled_windows(data, 50, max_windows=3)
    assert torch.equal(tx.flatten(), data[:150].long()) and torch.equal(ty.flatten(),
                                                                          data[1:151].long())
    with pytest.raises(ValueError, match="shorter"):
        charlm.random_windows(data[:10], 1, 32, torch.Generator())


# ---------------------------------------------------------------- task streams
def test_train_batches_are_a_function_of_seed_and_step(tmp_path):
    task = make_task("listops", 32, seed=1, data_dir=tmp_path, train_size=64, valid_size=8,
                     test_size=8)
    again = make_task("listops", 32, seed=1, data_dir=tmp_path, train_size=64, valid_size=8,
                      test_size=8)  # from the cache
    assert sorted(p.name for p in tmp_path.iterdir())[0].startswith("listops-L32")
    assert torch.equal(task.train_batch(5, 8)[0], again.train_batch(5, 8)[0])
    assert not torch.equal(task.train_batch(5, 8)[0], task.train_batch(6, 8)[0])
    assert torch.equal(task.eval_sets["test"][1], again.eval_sets["test"][1])
    other = make_task("recall", 32, seed=2)
    assert torch.equal(other.train_batch(3, 4)[0], make_task("recall", 32, 2).train_batch(3, 4)[0])
    assert stream_seed(0, "a", 1) != stream_seed(0, "a", 2) != stream_seed(1, "a", 1)


def test_make_task_errors_and_score():
    with pytest.raises(ValueError, match="unknown task"):
        make_task("nope", 32, 0)
    with pytest.raises(ValueError, match="seq_len"):
        make_task("copy", 2, 0)
    task = make_task("copy", 16, 0)
    assert task.kind == "lm" and task.metric == "accuracy"
    out = score(task, loss_sum=8.0, correct=3, count=4)
    assert out == {"loss": 2.0, "accuracy": 0.75}
    task.metric = "bpc"
    assert score(task, 4 * 0.6931471805599453, 0, 4)["bpc"] == pytest.approx(1.0)
