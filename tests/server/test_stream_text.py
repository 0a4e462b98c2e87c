"""Streamed text == decode(ids) for every id sequence, on the packaged Gemma 3 tokenizer (byte-fallback tokens,
skipped specials between byte runs: the defect issue 23 found)."""
from __future__ import annotations

import random

import pytest

from sparrow.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def gemma_tokenizer():
    from sparrow.default_model import default_model_path
    from sparrow.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


def _stream(tok, ids, skip=True):
    d = IncrementalDetokenizer(tok, [tok.bos_token_id], skip)
    return "".join(d.add(i) for i in ids) + d.flush()


def test_skipped_special_inside_byte_run(gemma_tokenizer):
    tok = gemma_tokenizer
    byte = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)]
    ids = [byte[b] for b in "🎉".encode()] + [tok.bos_token_id, byte[0x80], byte[0x80]]
    ref = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert _stream(tok, ids) == ref
    ref_kept = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert _stream(tok, ids, skip=False) == ref_kept  # a rendered special ends the run


@pytest.mark.parametrize("skip", [True, False])
def test_random_mixes_equal_decode(gemma_tokenizer, skip):
    """300 random mixes of byte runs (valid characters and stray bytes), words and specials."""
    tok = gemma_tokenizer
    byte = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)]
    words = tok("hello world, 🎉 café 日本語", add_special_tokens=False)["input_ids"]
    specials = [tok.bos_token_id, tok.eos_token_id, tok.convert_tokens_to_ids("<start_of_turn>")]
    rng = random.Random(0)
    bad = []
    for _ in range(300):
        ids = []
        for _ in range(rng.randint(1, 12)):
            k = rng.random()
            if k < 0.3:
                ids += [byte[b] for b in rng.choice(["🎉", "é", "日"]).encode()]
            elif k < 0.5:
                ids.append(rng.choice(byte[128:]))
            elif k < 0.75:
                ids.append(rng.choice(words))
            else:
                ids.append(rng.choice(specials))
        ref = tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        if _stream(tok, ids, skip) != ref:
            bad.append(ids)
    assert not bad, f"{len(bad)} of 300 disagree, e.g. {tok.convert_ids_to_tokens(bad[0])}"
