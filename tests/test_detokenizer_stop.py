"""decode.stop_strings: text stop sequences found across token boundaries and cut from the output."""

from __future__ import annotations

import random

import pytest

from mlxcel import load_generator
from mlxcel.config import validate_config
from mlxcel.errors import ConfigError
from mlxcel.tokenizer import DeferredTextStream, StopStringFilter, TextStream
from tests.helpers import CORPUS, load_smollm2, read_run, requires_smollm2, run_cli


def cut_at_first(text: str, stops: list[str]) -> str:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(found)] if found else text


@pytest.mark.parametrize("seed", range(20))
def test_filter_equals_cutting_the_whole_text(seed):
    rng = random.Random(seed)
    text = rng.choice(CORPUS[:10]) * 2
    stops = [text[i : i + rng.randint(1, 6)] for i in (rng.randrange(len(text)) for _ in range(2))] + ["never there"]
    cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stop_filter = StopStringFilter(stops)
    out = [stop_filter.push(c) for c in chunks] + [stop_filter.flush()]
    assert "".join(out) == cut_at_first(text, stops)
    assert stop_filter.stopped
    assert not any(s in "".join(out) for s in stops)


def test_filter_holds_a_possible_start_and_releases_it():
    stop_filter = StopStringFilter(["\n\nUser:"])
    assert stop_filter.push("Hello\n") == "Hello"  # "\n" may start the stop string
    assert stop_filter.push("\nUs") == ""
    assert stop_filter.push("ed it") == "\n\nUsed it"  # it did not
    assert stop_filter.push("\n\nUser: hi") == "" and stop_filter.stopped
    assert stop_filter.push("more") == "" and stop_filter.flush() == ""
    assert StopStringFilter([]).push("x") == "x"


@requires_smollm2
def test_text_stream_cuts_across_token_boundaries():
    tok = load_smollm2()
    text = "The capital of France is Paris. 日本の首都は東京です。"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert "Paris. 日本" not in pieces and len(ids) > 10  # the stop string spans several tokens
    stream = TextStream(tok, ["Paris. 日本"])
    chunks = []
    for i in ids:
        chunks.append(stream.add_token(i))
        if stream.stopped:
            break
    chunks.append(stream.finalize())
    assert "".join(chunks) == stream.text == "The capital of France is "
    free = TextStream(tok, ["not in it"])
    assert "".join([free.add_token(i) for i in ids] + [free.finalize()]) == tok.decode(ids) == text


@requires_smollm2
def test_deferred_text_equals_the_streamed_text():
    """Rows nobody watches and no stop string can end decode once at the end: the same text."""
    tok = load_smollm2()
    for text in CORPUS[:10]:
        ids = tok.encode(text, add_special_tokens=False)
        streamed, deferred = TextStream(tok), DeferredTextStream(tok)
        assert [deferred.add_token(i) for i in ids] == [""] * len(ids) and not deferred.stopped
        streamed_text = "".join([streamed.add_token(i) for i in ids] + [streamed.finalize()])
        assert deferred.finalize() == deferred.text == streamed_text == tok.decode(ids)


def test_rows_decode_once_only_where_nothing_reads_them(tiny_generator):
    pipeline = tiny_generator.pipeline
    assert isinstance(pipeline.make_text_stream(streaming=False), DeferredTextStream)
    assert isinstance(pipeline.make_text_stream(), TextStream)
    before = pipeline.cfg.decode.stop_strings
    pipeline.cfg.decode.stop_strings = ["x"]
    try:
        assert isinstance(
            pipeline.make_text_stream(streaming=False), TextStream
        )  # a stop string needs the text as it grows
    finally:
        pipeline.cfg.decode.stop_strings = before


@pytest.fixture(scope="module")
def tiny_generator(tiny_llama):
    return load_generator(
        {"model": {"path": str(tiny_llama), "max_context": 128}},
        overrides=["decode.max_tokens=12", "decode.ignore_eos=true"],
    )


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_generation_stops_at_a_stop_string(tiny_generator, tiny_llama, tmp_path):
    prompt = "Hello, world: how are you?"
    free = tiny_generator.generate(prompt)
    pieces = [tiny_generator.pipeline.tokenizer.decode(free.token_ids[:n]) for n in range(len(free.token_ids) + 1)]
    # a stop string that starts inside one token and ends in a later one
    start = next(n for n in range(2, len(pieces) - 2) if len(pieces[n]) - len(pieces[n - 1]) >= 2)
    begin = len(pieces[start]) - 1
    stop = free.text[begin : len(pieces[start + 1]) + 1]
    assert len(stop) >= 2, free.text
    expected = cut_at_first(free.text, [stop])

    stopped = load_generator(
        {"model": {"path": str(tiny_llama), "max_context": 128}},
        overrides=["decode.max_tokens=12", "decode.ignore_eos=true", f"decode.stop_strings=[{stop!r}]"],
    )
    out = stopped.generate(prompt)
    assert (out.text, out.finish_reason) == (expected, "stop")
    assert out.token_ids == free.token_ids[: len(out.token_ids)] and len(out.token_ids) < len(free.token_ids)
    assert "".join(stopped.stream(prompt)) == expected and stopped.stats.finish_reasons == {"stop": 1}

    result = run_cli(
        tmp_path,
        f"model.path={tiny_llama}",
        "decode.max_tokens=12",
        "decode.ignore_eos=true",
        f"prompt.text={prompt}",
        f"decode.stop_strings=[{stop!r}]",
    )
    assert result.returncode == 0, result.stderr
    row = read_run(tmp_path)[1][0]
    assert (row["text"], row["finish_reason"]) == (expected, "stop")


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_text_held_back_for_a_stop_string_is_kept_once(tiny_generator, tiny_llama, tmp_path):
    """A row that ends (at max_tokens) on the start of a stop string: the held-back text is the
    row's tail, written once (the run folder once wrote it twice)."""
    prompt = "Hello, world: how are you?"
    free = tiny_generator.generate(prompt)
    stop = free.text[-2:] + "\u2603never"  # begins with the text's last two characters, never completes
    result = run_cli(
        tmp_path,
        f"model.path={tiny_llama}",
        "decode.max_tokens=12",
        "decode.ignore_eos=true",
        f"prompt.text={prompt}",
        f"decode.stop_strings=[{stop!r}]",
    )
    assert result.returncode == 0, result.stderr
    row = read_run(tmp_path)[1][0]
    assert (row["text"], row["finish_reason"]) == (free.text, "length")


def test_empty_stop_string_is_a_config_error():
    with pytest.raises(ConfigError, match=r"decode.stop_strings: stop strings must not be empty"):
        validate_config(
            {"model": {"path": "embedded:smollm2"}, "decode": {"stop_strings": ["ok", ""]}, "prompt": {"text": "x"}}
        )
