"""Splitting a merged reply as it streams gives each member what the whole-reply splitter would, earlier."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mergebroker.merge.split import BlockFailure, split_reply
from mergebroker.merge.stream_split import BlockClosed, BlockDelta, StreamSplitter, releasable

IDS = ["K42", "B07", "Q11"]


def run(chunks: list[str], finish_reason: str | None = "stop", ids=IDS):
    splitter = StreamSplitter(ids)
    events = [e for chunk in chunks for e in splitter.feed(chunk)]
    return events + splitter.finish(finish_reason)


def closed(events) -> dict:
    return {e.id: e.answer for e in events if isinstance(e, BlockClosed)}


def test_each_block_closes_as_soon_as_its_tag_arrives():
    splitter = StreamSplitter(IDS)
    assert splitter.feed("<K42>\nfirst ans") == [BlockDelta("K42", "\nfirst ans")]
    events = splitter.feed("wer\n</K42>\n<B07>")
    assert events == [BlockDelta("K42", "wer\n"), BlockClosed("K42", "first answer")]
    assert splitter.pending == ["B07", "Q11"]


def test_a_tag_split_across_deltas_is_read_whole():
    reply = "<K42>one</K42><B07>two < three and x<y1</B07>"
    chunks = [reply[i:i + 1] for i in range(len(reply))]  # one character at a time
    events = run(chunks)
    assert closed(events) == {"K42": "one", "B07": "two < three and x<y1", "Q11": BlockFailure.MISSING}
    assert "".join(e.text for e in events if isinstance(e, BlockDelta) and e.id == "B07") == "two < three and x<y1"


def test_failures_match_the_whole_reply_splitter():
    reply = "<K42>  </K42><B07>see B07 and K42</B07><Q11>cut short"
    assert closed(run([reply], "length")) == split_reply(reply, IDS, finish_reason="length")
    assert closed(run([reply], "stop"))["Q11"] is BlockFailure.MALFORMED


def test_a_block_opened_inside_another_fails_the_outer_one_at_once():
    splitter = StreamSplitter(IDS)
    events = splitter.feed("<K42>text <B07>other</B07>")
    assert BlockClosed("K42", BlockFailure.MALFORMED) in events
    assert BlockClosed("B07", "other") in events


def test_a_block_closed_by_another_ids_tag_fails_at_once():
    splitter = StreamSplitter(IDS)
    assert BlockClosed("K42", BlockFailure.MALFORMED) in splitter.feed("<K42>text</B07>")


def test_a_second_block_for_an_answered_id_is_ignored():
    events = run(["<K42>first</K42><K42>second</K42>"])
    assert closed(events)["K42"] == "first"


def test_unknown_ids_and_chatter_reach_nobody():
    events = run(["Sure! <Z99>x</Z99> <K42>y</K42> bye"])
    assert closed(events)["K42"] == "y"
    assert all(e.id in IDS for e in events)


_pieces = st.lists(st.sampled_from([
    "<K42>", "<B07>", "<Q11>", "</K42>", "</B07>", "</Q11>", "<k42 >", "a < b", "</ Q11>", "<K4", "</B07 x>", "<Z99>",
    "words and more words", " ", "\n", "x < y", "<b>", "K42"]), max_size=12)


@settings(max_examples=300, deadline=None)
@given(_pieces, st.lists(st.integers(min_value=0, max_value=400), max_size=8), st.sampled_from(["stop", "length"]))
def test_any_chunking_gives_the_same_events_as_the_whole_reply(pieces, cuts, finish_reason):
    reply = "".join(pieces)
    points = sorted({c % (len(reply) + 1) for c in cuts})
    chunks = [reply[a:b] for a, b in zip([0, *points], [*points, len(reply)])]
    whole, chunked = run([reply], finish_reason), run(chunks, finish_reason)
    assert closed(whole) == closed(chunked)
    for member in IDS:  # deltas may be cut differently, never differ in text
        text = ["".join(e.text for e in events if isinstance(e, BlockDelta) and e.id == member)
                for events in (whole, chunked)]
        assert text[0] == text[1]


@settings(max_examples=300, deadline=None)
@given(_pieces, st.sampled_from(["stop", "length"]))
def test_without_duplicates_answers_equal_the_whole_reply_splitter(pieces, finish_reason):
    reply = "".join(pieces)
    batch = split_reply(reply, IDS, finish_reason=finish_reason)
    streamed = closed(run([reply], finish_reason))
    for member in IDS:
        if batch[member] in (BlockFailure.DUPLICATED, BlockFailure.MALFORMED):
            continue  # answered early, a later duplicate or stray close cannot take the answer back
        assert streamed[member] == batch[member], (reply, member)


def test_releasable_holds_back_the_last_words():
    text = "one two three four five"
    assert text[:releasable(text, 2)] == "one two three "
    assert releasable("one two", 2) == 0
    assert releasable(text, 0) == len(text)
