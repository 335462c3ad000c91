"""espo.data.stream.PromptStream: deterministic order, a new permutation per epoch, exact resume,
the accept filter and its draw cap."""

import json

import pytest

from espo.data import stream


def _ids(examples):
    return [e.id for e in examples]


def test_same_seed_same_order_other_seed_other_order(make_source):
    source = make_source(10)
    a = _ids(stream.PromptStream(source, seed=3).take(25))
    b = _ids(stream.PromptStream(source, seed=3).take(25))
    c = _ids(stream.PromptStream(source, seed=4).take(25))
    assert a == b and a != c


def test_each_epoch_is_a_fresh_permutation(make_source):
    source = make_source(12)
    s = stream.PromptStream(source, seed=0)
    epochs = [_ids(s.take(12)) for _ in range(3)]
    everything = sorted(_ids(source))
    for epoch in epochs:
        assert sorted(epoch) == everything  # each example once per epoch
    assert epochs[0] != _ids(source)  # shuffled
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]  # reshuffled every epoch
    assert s.metrics()["data/epochs"] == pytest.approx(3.0)


def test_exact_resume_from_state_dict(make_source):
    source = make_source(9)
    s = stream.PromptStream(source, seed=5)
    s.take(4)
    s.take(3, accept=lambda e: e.answer != "2")
    state = json.loads(json.dumps(s.state_dict()))  # JSON-serialisable
    expected = _ids(s.take(20)), s.metrics()

    fresh = stream.PromptStream(source, seed=5)
    fresh.load_state_dict(state)
    assert (_ids(fresh.take(20)), fresh.metrics()) == expected


def test_state_from_another_stream_is_an_error(make_source):
    state = stream.PromptStream(make_source(9), seed=5).state_dict()
    with pytest.raises(ValueError, match="seed: state 5 vs stream 6"):
        stream.PromptStream(make_source(9), seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="source_len: state 9 vs stream 8"):
        stream.PromptStream(make_source(8), seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="no \\['iterator'"):
        stream.PromptStream(make_source(9), seed=5).load_state_dict({"version": 1})


def test_accept_filter_consumes_and_counts_rejected(make_source):
    source = make_source(10)
    plain = _ids(stream.PromptStream(source, seed=1).take(30))
    s = stream.PromptStream(source, seed=1)
    even = s.take(8, accept=lambda e: int(e.answer) % 2 == 0)
    assert len(even) == 8 and all(int(e.answer) % 2 == 0 for e in even)
    # The accepted examples are the even ones of the unfiltered order, in that order.
    drawn = s.metrics()["data/epochs"] * len(source)
    prefix = plain[: round(drawn)]
    assert _ids(even) == [i for i in prefix if int(i.rsplit(":", 1)[1]) % 2 == 0]
    assert prefix[-1] == even[-1].id  # stopped at the 8th accepted draw
    assert s.metrics()["data/rejected"] == len(prefix) - 8
    # The next draw continues right after.
    assert _ids(s.take(2)) == plain[len(prefix) : len(prefix) + 2]


@pytest.mark.slow
def test_take_stops_after_max_draws(make_source):
    s = stream.PromptStream(make_source(5, num_skipped=2), seed=0)
    assert s.take(3, accept=lambda e: False) == []  # default cap: 100 * n draws
    assert s.metrics() == {
        "data/epochs": pytest.approx(300 / 5),
        "data/rejected": 300.0,
        "data/skipped_records": 2.0,
    }
    got = s.take(4, accept=lambda e: e.answer == "0", max_draws=10)
    assert len(got) == 2 and s.metrics()["data/rejected"] == 308.0  # 2 of 10 draws accepted
    assert s.take(0) == []


def test_bad_arguments(make_source):
    with pytest.raises(ValueError, match="PromptStream.seed=-1"):
        stream.PromptStream(make_source(3), seed=-1)
    with pytest.raises(ValueError, match="empty"):
        stream.PromptStream(make_source(0), seed=0)
    with pytest.raises(ValueError, match="n=-1"):
        stream.PromptStream(make_source(3), seed=0).take(-1)
