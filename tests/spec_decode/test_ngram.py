import random

import numpy as np
import pytest

from verispec.sampling_params import SamplingParams
from verispec.spec_decode import DraftBatch, Drafter, DraftRequest, NgramDrafter
from verispec.spec_decode.ngram import propose_ngram


def request(token_ids, k=5, request_id="r"):
    return DraftRequest(request_id, list(token_ids), k, SamplingParams(), seed=0, step=0)


def propose(drafter, token_ids, k=5, request_id="r"):
    batch = drafter.propose([request(token_ids, k, request_id)])
    assert batch.probs is None
    return batch.token_ids[0]


def slow_reference(tokens, min_n, max_n, k):
    """The rule spelled out: longest n, most recent earlier match, overlapping copy."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                ext = list(tokens)
                for i in range(k):
                    ext.append(ext[start + n + i])
                return ext[length:]
    return []


def test_is_a_drafter():
    assert isinstance(NgramDrafter(), Drafter)


@pytest.mark.parametrize(
    "kwargs, name",
    [({"min_n": 0}, "min_n=0"), ({"max_n": 0}, "max_n=0"), ({"min_n": 3, "max_n": 2}, "max_n=2"),
     ({"num_speculative_tokens": 0}, "num_speculative_tokens=0"), ({"min_n": 1.5}, "min_n=1.5")],
)
def test_validates_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        NgramDrafter(**kwargs)


def test_proposes_what_followed_the_match():
    d = NgramDrafter(min_n=1, max_n=3, num_speculative_tokens=5)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 2, 3]
    assert propose(d, tokens, k=3) == [4, 5, 6]


def test_most_recent_match_is_preferred():
    d = NgramDrafter(min_n=2, max_n=2)
    tokens = [7, 8, 1, 1, 9, 9, 7, 8, 2, 2, 0, 7, 8]
    assert propose(d, tokens, k=2) == [2, 2]


def test_longer_match_is_preferred_over_more_recent_shorter_one():
    d = NgramDrafter(min_n=1, max_n=3)
    # "5 6 7" occurs at the start, followed by 40 41; only "7" recurs later, followed by 99.
    tokens = [5, 6, 7, 40, 41, 0, 7, 99, 1, 5, 6, 7]
    assert propose(d, tokens, k=2) == [40, 41]
    # With max_n = 1 only the last token is matched, so the latest "7" wins.
    assert propose(NgramDrafter(1, 1), tokens, k=2, request_id="other") == [99, 1]


def test_min_n_rejects_short_matches():
    tokens = [3, 9, 9, 4, 3]
    assert propose(NgramDrafter(1, 3), tokens, k=2) == [9, 9]
    assert propose(NgramDrafter(2, 3), tokens, k=2) == []


def test_no_match_or_too_short_context_proposes_nothing():
    d = NgramDrafter()
    assert propose(d, [1, 2, 3, 4], request_id="a") == []
    assert propose(d, [1], request_id="b") == []
    assert propose(d, [], request_id="c") == []


def test_k_zero_proposes_nothing():
    assert propose(NgramDrafter(), [1, 2, 1, 2, 1], k=0) == []


def test_proposals_capped_by_request_k_and_drafter_k():
    tokens = list(range(20)) + [0]
    assert propose(NgramDrafter(num_speculative_tokens=5), tokens, k=3) == [1, 2, 3]
    assert propose(NgramDrafter(num_speculative_tokens=4), tokens, k=10) == [1, 2, 3, 4]


def test_match_near_the_end_continues_the_repetition():
    d = NgramDrafter(min_n=1, max_n=3)
    # Period 2: the latest "1 2 1" ends one token before the end, followed only by "2".
    assert propose(d, [1, 2, 1, 2, 1], k=5) == [2, 1, 2, 1, 2]
    assert propose(d, [4, 4, 4], k=3, request_id="s") == [4, 4, 4]


def test_batch_keeps_request_order_and_per_request_k():
    d = NgramDrafter()
    batch = d.propose([
        request([1, 2, 3, 1], k=2, request_id="a"),
        request([5, 6], k=4, request_id="b"),
        request([9, 8, 9], k=0, request_id="c"),
        request([9, 8, 7, 9], k=1, request_id="d"),
    ])
    assert isinstance(batch, DraftBatch)
    assert batch.token_ids == [[2, 3], [], [], [8]]
    assert batch.num_draft_tokens == [2, 0, 0, 1]
    assert batch.probs is None


def test_state_follows_growing_context_and_release():
    d = NgramDrafter(min_n=1, max_n=2)
    tokens = [1, 2, 3, 4, 5]
    assert propose(d, tokens) == []
    tokens += [1, 2]
    assert propose(d, tokens, k=3) == [3, 4, 5]
    tokens += [3, 9, 9, 9] * 10  # grows the buffer past its first capacity
    assert propose(d, tokens, k=3) == slow_reference(tokens, 1, 2, 3)
    # A reused id with a different context is detected and rebuilt.
    assert propose(d, [7, 8, 7], k=2) == [8, 7]
    d.release("r")
    d.release("never-seen")
    assert d._buffers == {}


@pytest.mark.parametrize("seed", range(3))
def test_matches_slow_reference_on_random_growing_contexts(seed):
    rng = random.Random(seed)
    d = NgramDrafter(min_n=1 + seed % 2, max_n=3 + seed, num_speculative_tokens=6)
    contexts = {f"r{i}": [rng.randrange(6) for _ in range(rng.randint(0, 30))] for i in range(8)}
    for _ in range(60):
        ids = rng.sample(sorted(contexts), 5)
        ks = [rng.randint(0, 8) for _ in ids]
        batch = d.propose([request(contexts[i], k, i) for i, k in zip(ids, ks)])
        for i, k, got in zip(ids, ks, batch.token_ids):
            assert got == slow_reference(contexts[i], d.min_n, d.max_n, min(k, 6))
            contexts[i] += [rng.randrange(6) for _ in range(rng.randint(1, 4))]


def test_propose_ngram_on_long_context():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=5000)
    tokens[-3:] = tokens[1000:1003]
    assert propose_ngram(tokens, 1, 3, 4) == tokens[1003:1007].tolist()


def test_draft_class_is_the_length_of_the_match_the_draft_comes_from():
    d = NgramDrafter(min_n=1, max_n=3, num_speculative_tokens=4)
    assert d.draft_class("r", [1, 2, 3]) is None  # no earlier occurrence of 3: nothing to draft
    assert d.draft_class("r", [1, 2, 3, 9, 3]) == 1
    assert d.draft_class("r", [1, 2, 3, 9, 3, 1, 2]) == 2
    tokens = [1, 2, 3, 9, 3, 1, 2, 3]
    assert d.draft_class("r", tokens) == 3
    # The draft that follows is the continuation of that match.
    assert propose(d, tokens, k=2) == slow_reference(tokens, 1, 3, 2) == [9, 3]
    d.release("r")
    assert d._indexes == {} and d._buffers == {} and d.draft_class("r", [5, 5]) == 1
    assert NgramDrafter(min_n=2).draft_class("q", [1, 2, 3, 9, 3]) is None  # min_n leaves the 1-token match out


@pytest.mark.parametrize("seed", range(3))
def test_the_incremental_index_finds_the_scans_match_as_contexts_grow_and_roll_back(seed):
    """draft_class and the draft read a per-request index of n-grams kept as tokens arrive; it
    finds best_match's (n, end) step after step, also after a context is cut back (rejected
    drafts) and grows again differently."""
    from verispec.spec_decode.ngram import best_match

    rng = random.Random(seed)
    d = NgramDrafter(min_n=1 + seed % 2, max_n=2 + seed)
    tokens = [rng.randrange(5) for _ in range(rng.randint(0, 6))]
    for _ in range(200):
        if rng.random() < 0.1 and len(tokens) > 3:
            tokens = tokens[: rng.randint(1, len(tokens) - 1)]  # a rollback
        tokens = tokens + [rng.randrange(5) for _ in range(rng.randint(1, 3))]
        expected = best_match(np.array(tokens, dtype=np.int64), d.min_n, d.max_n)
        assert d.match("r", tokens) == expected
