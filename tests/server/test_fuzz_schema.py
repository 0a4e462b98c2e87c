"""Property-based fuzzing of the server from its own OpenAPI schema (schemathesis, negative mode: bodies that
break the schema -- wrong types, missing required fields, values out of the declared ranges): at least 1,000
requests over every operation, each answered with a 4xx (or a 200 where the mutation stays valid), never a 5xx;
afterwards no request or KV block is held and the server still answers.

The served model is the tiny random Llama with a byte tokenizer at max_model_len 64, so a request that happens
to be valid generates at most a few dozen tokens (the run stays within about a minute on a 2-core machine)."""
from __future__ import annotations

import pytest

from tests.server.conftest import start_server, stop_server
from tests.server.test_server import _wait_idle

EXAMPLES = {"/tokenize": 150, "/detokenize": 100, "/v1/completions": 375, "/v1/chat/completions": 375}
"""Cases per POST operation (the GET operations take no input: one case each)."""


@pytest.fixture(scope="module")
def fuzz_server(tiny_text_model_dir):
    from sparrow import LLM

    llm = LLM(str(tiny_text_model_dir), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=64,
              max_num_seqs=16)
    running = start_server(llm, served_model_name="tiny")
    yield running
    stop_server(running)


def test_schema_fuzz_never_5xx(fuzz_server):
    import requests
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    ops = [op.ok() for op in schema.get_all_operations()]
    assert set(EXAMPLES) <= {op.path for op in ops}
    sent, failures = [0], []
    with requests.Session() as session:
        for op in ops:
            mode = GenerationMode.NEGATIVE if op.path in EXAMPLES else GenerationMode.POSITIVE  # GET: no input

            @settings(max_examples=EXAMPLES.get(op.path, 1), deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(op.as_strategy(generation_mode=mode))
            def check(case):
                r = case.call(session=session, base_url=fuzz_server.url, timeout=60)
                sent[0] += 1
                if r.status_code >= 500:
                    failures.append((case.method, case.path, case.body, r.status_code, r.text[:300]))

            check()
    assert not failures, failures[:5]
    assert sent[0] >= 1000, sent[0]
    _wait_idle(fuzz_server)
    r = requests.post(fuzz_server.base_url + "/completions", json={"prompt": "still here", "max_tokens": 3},
                      timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
