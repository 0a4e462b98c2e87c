"""Fixtures of the structured-output tests: the tiny random Llama with a byte tokenizer whose EOS (token 2) is a
special token, so finished texts carry no EOS byte and a JSON output is the whole text; a minimal chat
template (role: content lines) for the server's chat route."""
from __future__ import annotations

import pytest

from tests.helpers import TINY_EOS, copy_checkpoint, save_byte_tokenizer, tiny_model_dir  # noqa: F401


@pytest.fixture(scope="session")
def tiny_eos_model_dir(tiny_model_dir, tmp_path_factory):  # noqa: F811
    from transformers import AutoTokenizer

    dst = copy_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("tiny-struct") / "tiny-llama-struct")
    save_byte_tokenizer(dst, chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                          "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    tok = AutoTokenizer.from_pretrained(str(dst))
    tok.eos_token = tok.convert_ids_to_tokens(TINY_EOS)
    tok.save_pretrained(str(dst))
    return dst
