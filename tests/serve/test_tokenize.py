"""The tokenizer endpoints of `paxkv-serve` (`paxkv.serve.tokenize`), in vLLM's shapes,
over HTTP: tiny-py's byte tokenizer (ids are the UTF-8 bytes), the chat rendering
/v1/chat/completions uses, and bad input answered 400 naming the field."""

import httpx
from serve_env import CHAT_TEMPLATE, MAX_MODEL_LEN


def _post(server, path, body):
    return httpx.post(f"{server.base}{path}", json=body, timeout=30)


def test_tokenize_and_detokenize_round_trip(server):
    text = "def f(x):\n    return 'é'"
    r = _post(server, "/tokenize", {"model": "tiny-py", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == list(text.encode("utf-8"))
    assert out["count"] == len(text.encode("utf-8")) and out["max_model_len"] == MAX_MODEL_LEN
    assert out["token_strs"][:3] == ["d", "e", "f"]
    assert _post(server, "/tokenize", {"prompt": text}).json()["token_strs"] is None
    back = _post(server, "/detokenize", {"tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_renders_messages_as_chat_completions_does(server):
    messages = [{"role": "user", "content": "hi"}]
    r = _post(server, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == list(b"user: hi\nassistant:")  # the server's template
    # The same prompt a chat completion runs on: its usage counts those tokens.
    chat = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == r.json()["count"]


def test_tokenizer_info(server):
    r = httpx.get(f"{server.base}/tokenizer_info", timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["chat_template"] == CHAT_TEMPLATE
    assert info["model_max_length"] == MAX_MODEL_LEN
    assert info["tokenizer_class"] == "ByteTokenizer"
    assert info["eos_token"] is None  # tiny-py has no special tokens


def test_bad_input_names_the_field(server):
    cases = [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "return_token_strs": 1}, "return_token_strs"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [1, 256]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
    ]
    for path, body, param in cases:
        r = _post(server, path, body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param, (path, body, r.json())
    r = _post(server, "/tokenize", {"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
