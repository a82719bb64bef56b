from coordinator.text import TextStream


class FakeDetokenizer:
    """Each token id is one character; id 0 is half of a character until the next token."""

    def __init__(self):
        self.last_segment, self._held = "", ""

    def add_token(self, token_id):
        if token_id == 0:
            self._held, self.last_segment = "é", ""
        else:
            self.last_segment, self._held = self._held + chr(token_id), ""

    def finalize(self):
        self.last_segment, self._held = self._held, ""


def feed(stream, text):
    return [stream.add(ord(c)) for c in text]


def test_text_without_stops_streams_as_it_comes():
    stream = TextStream(FakeDetokenizer(), [])
    feed(stream, "hello")
    assert stream.take() == "hello" and stream.finish() == ""


def test_possible_stop_prefix_is_held_back_then_released():
    stream = TextStream(FakeDetokenizer(), ["END"])
    feed(stream, "abcEN")
    assert stream.take() == "abc"  # "EN" could still become "END"
    feed(stream, "x")
    # len("END") - 1 characters stay held until more text or the end
    assert stream.take() == "E" and stream.finish() == "Nx"


def test_stop_string_cuts_the_text_across_tokens():
    stream = TextStream(FakeDetokenizer(), ["<stop>", "zz"])
    hits = feed(stream, "one two <st") + feed(stream, "op> more")
    assert hits.index(True) == len("one two <stop>") - 1
    assert stream.stopped and stream.take() + stream.finish() == "one two "


def test_finish_flushes_an_unfinished_character():
    stream = TextStream(FakeDetokenizer(), [])
    stream.add(ord("a"))
    stream.add(0)
    assert stream.take() == "a" and stream.finish() == "é"
