"""Chat templates (`paxkv.text.chat`) against transformers' own `apply_chat_template`.

The oracle is transformers itself (tokenizers only, no torch), reading the same
checkpoint files: a byte-level BPE `tokenizer.json` whose post-processor adds BOS (so a
doubled BOS would show), and a `tokenizer_config.json` with real models' templates.
"""

import pytest

pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from chat_checkpoints import (  # noqa: E402
    ASSISTANT,
    BOS,
    CHATML,
    CONVERSATIONS,
    EOS,
    JSONISH,
    LLAMA3,
    MISTRAL,
    SYSTEM,
    USER,
    USER2,
    transformers_side,
    write_tokenizer,
)

from paxkv.text import chat, template_sandbox  # noqa: E402


def paxkv_side(directory, conversations, **kwargs):
    """paxkv's rendered texts and token ids for `conversations`."""
    from paxkv.models import load_tokenizer

    templates = chat.ChatTemplates.from_checkpoint(str(directory), "tokenizer_config.json")
    # transformers' defaults; its other keyword arguments are template variables.
    options = {
        "add_generation_prompt": kwargs.pop("add_generation_prompt", False),
        "continue_final_message": kwargs.pop("continue_final_message", False),
    }
    chat_template = kwargs.pop("chat_template", None)
    texts = chat.render(
        templates.get(chat_template),
        chat.parse_conversations(conversations),
        special_tokens=templates.special_tokens,
        chat_template_kwargs=kwargs,
        **options,
    )
    tokenizer = load_tokenizer(directory)
    return texts, [chat.encode_rendered(tokenizer, t) for t in texts]


def both_sides(directory, conversations, **kwargs):
    """paxkv's and transformers' (texts, ids), which the tests expect to be equal."""
    return paxkv_side(directory, conversations, **kwargs), transformers_side(
        directory, conversations, **kwargs
    )


@pytest.mark.parametrize("template", [LLAMA3, CHATML], ids=["llama3", "chatml"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_and_tokenizes_as_transformers(tmp_path, template, add_generation_prompt):
    write_tokenizer(tmp_path, template)
    ours, theirs = both_sides(tmp_path, CONVERSATIONS, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    texts, ids = ours
    if template is LLAMA3:
        from paxkv.models import load_tokenizer

        bos = load_tokenizer(tmp_path)._tokenizer.token_to_id(BOS)
        assert all(
            t.startswith(BOS) and i[0] == bos and i.count(bos) == 1
            for t, i in zip(texts, ids, strict=True)
        )
        # The tokenizer's own encode adds BOS again: why chat encodes without it.
        assert load_tokenizer(tmp_path).encode(texts[0])[:2] == [bos, bos]
    assert (
        texts[0].endswith("assistant<|end_header_id|>\n\n" if template is LLAMA3 else "assistant\n")
        == add_generation_prompt
    )


@pytest.mark.parametrize("template", [LLAMA3, CHATML], ids=["llama3", "chatml"])
@pytest.mark.parametrize("partial", ["I am ", "Sure: "])
def test_continue_final_message_as_transformers(tmp_path, template, partial):
    write_tokenizer(tmp_path, template)
    conversations = [[SYSTEM, USER, {"role": "assistant", "content": partial}]]
    ours, theirs = both_sides(tmp_path, conversations, continue_final_message=True)
    assert ours == theirs
    # Llama 3 trims the content (the trailing space goes); ChatML keeps it.
    assert ours[0][0].endswith(partial.rstrip() if template is LLAMA3 else partial)


def test_raise_exception_and_eos_as_transformers(tmp_path):
    write_tokenizer(tmp_path, MISTRAL)
    good = [[USER, ASSISTANT, USER2]]
    ours, theirs = both_sides(tmp_path, good)
    assert ours == theirs and EOS in ours[0][0]
    bad = [[USER], [USER, {"role": "tool", "content": "42"}]]
    with pytest.raises(Exception, match="Only user and assistant roles") as theirs_error:
        transformers_side(tmp_path, bad[1:])
    message = str(theirs_error.value)
    with pytest.raises(ValueError, match=r"conversation 1: the chat template raised: ") as e:
        paxkv_side(tmp_path, bad)
    assert str(e.value).endswith(message)


def test_tojson_kwargs_loop_controls_and_generation_blocks_as_transformers(tmp_path):
    write_tokenizer(tmp_path, JSONISH)
    conversations = [[USER, {"role": "skip", "content": "x"}, USER2]]
    ours, theirs = both_sides(tmp_path, conversations, add_generation_prompt=True, style="<b>é</b>")
    assert ours == theirs
    assert '"<b>é</b>"' in ours[0][0] and "skip" not in ours[0][0]


def test_named_templates_and_the_jinja_file(tmp_path):
    named = [{"name": "default", "template": LLAMA3}, {"name": "chatml", "template": CHATML}]
    write_tokenizer(tmp_path, named)
    for kwargs in ({}, {"chat_template": "chatml"}, {"chat_template": MISTRAL}):
        ours, theirs = both_sides(tmp_path, [[USER]], **kwargs)
        assert ours == theirs
    assert paxkv_side(tmp_path, [[USER]], chat_template="chatml")[0][0].startswith("<|im_start|>")
    # transformers' newer layout: chat_template.jinja replaces the config's default.
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    ours, theirs = both_sides(tmp_path, [[USER]])
    assert ours == theirs and ours[0][0].startswith("<|im_start|>system")


def test_missing_templates_say_how_to_pass_one(tmp_path):
    write_tokenizer(tmp_path, None)
    templates = chat.ChatTemplates.from_checkpoint(str(tmp_path), "tokenizer_config.json")
    assert templates.special_tokens == {"bos_token": BOS, "eos_token": EOS}
    with pytest.raises(ValueError, match=r"has no chat template .*pass chat_template="):
        templates.get()
    assert templates.get(CHATML) == CHATML
    none = chat.ChatTemplates.from_checkpoint(None, "tokenizer_config.json")
    with pytest.raises(ValueError, match="no chat template"):
        none.get()
    named = [{"name": "a", "template": LLAMA3}, {"name": "b", "template": CHATML}]
    write_tokenizer(tmp_path, named)
    templates = chat.ChatTemplates.from_checkpoint(str(tmp_path), "tokenizer_config.json")
    with pytest.raises(
        ValueError,
        match=r"has chat templates \['a', 'b'\] and none named 'default': pass chat_template=",
    ):
        templates.get()
    assert templates.get("b") == CHATML
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": 3}')
    with pytest.raises(ValueError, match="chat_template must be a string or a list"):
        chat.ChatTemplates.from_checkpoint(str(tmp_path), "tokenizer_config.json")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read .*tokenizer_config\.json"):
        chat.ChatTemplates.from_checkpoint(str(tmp_path), "tokenizer_config.json")


BAD_MESSAGES = [
    ("hi", TypeError, r"messages must be a list of message dicts .* got str"),
    ({"role": "user", "content": "x"}, TypeError, r"messages must be a list .* got dict"),
    ([], ValueError, "messages is empty"),
    ([[USER], "x"], TypeError, r"conversation 1 must be a list of message dicts, got str"),
    ([[USER], []], ValueError, r"conversation 1 is empty"),
    (
        [USER, "x"],
        TypeError,
        r"conversation 0, message 1 must be a dict with 'role' and 'content', got str",
    ),
    ([[USER], [USER, {"role": "user"}]], ValueError, r"conversation 1, message 1 has no 'content'"),
    ([{"content": "x"}], ValueError, r"conversation 0, message 0 has no 'role'"),
    (
        [{"role": 1, "content": "x"}],
        TypeError,
        r"conversation 0, message 0: role must be a str, got int 1",
    ),
    (
        [{"role": "user", "content": None}],
        TypeError,
        r"message 0: content must be a str, got NoneType",
    ),
    (
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        TypeError,
        r"message 0: content must be a str, got list",
    ),
    ([{"role": "", "content": "x"}], ValueError, r"conversation 0, message 0: role is empty"),
    (
        [{"role": "user", "content": "x", 1: "y"}],
        TypeError,
        r"message 0: keys must be strings, got 1",
    ),
]


@pytest.mark.parametrize(("messages", "error", "match"), BAD_MESSAGES)
def test_bad_messages_name_the_conversation_message_and_field(messages, error, match):
    with pytest.raises(error, match=match):
        chat.parse_conversations(messages)


def test_parsed_messages_are_copies_without_none_values():
    message = {"role": "user", "content": "x", "name": None}
    (parsed,) = chat.parse_conversations([message])
    assert parsed == [{"role": "user", "content": "x"}] and parsed[0] is not message


BAD_OPTIONS = [
    (dict(add_generation_prompt=1), TypeError, "add_generation_prompt must be a bool, got 1"),
    (dict(continue_final_message="yes"), TypeError, "continue_final_message must be a bool"),
    (
        dict(add_generation_prompt=True, continue_final_message=True),
        ValueError,
        "add_generation_prompt and continue_final_message cannot both be True",
    ),
    (dict(chat_template_kwargs=["x"]), TypeError, "chat_template_kwargs must be a dict, got list"),
    (dict(chat_template_kwargs={"messages": []}), ValueError, "may not set 'messages'"),
    (dict(chat_template_kwargs={1: 2}), TypeError, "keys must be strings, got 1"),
]


@pytest.mark.parametrize(("options", "error", "match"), BAD_OPTIONS)
def test_bad_options_are_rejected(options, error, match):
    with pytest.raises(error, match=match):
        chat.render(CHATML, [[USER]], **options)


def test_templates_are_sandboxed_and_must_parse():
    conversation = chat.parse_conversations([USER])
    with pytest.raises(ValueError, match=r"conversation 0: the chat template raised: .*unsafe"):
        chat.render("{{ messages.append(1) }}", conversation)
    assert conversation == [[USER]]
    with pytest.raises(ValueError, match="conversation 0: the chat template raised"):
        chat.render("{{ ''.__class__.__mro__[1].__subclasses__() }}", conversation)
    with pytest.raises(ValueError, match=r"the chat template does not parse: .*line 1"):
        chat.render("{% for m in messages %}", conversation)
    with pytest.raises(ValueError, match=r"dropped .* the final message"):
        chat.render(
            "{% for m in messages %}{{ m.content[:2] }}{% endfor %}",
            chat.parse_conversations([USER, {"role": "assistant", "content": "Sure thing"}]),
            add_generation_prompt=False,
            continue_final_message=True,
        )


def test_jinja2_is_imported_only_to_render(monkeypatch):
    import subprocess
    import sys

    code = (
        "import sys, paxkv.text.chat; assert not {'jinja2', 'jax'} & set(sys.modules), sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    for name in ("jinja2", "jinja2.ext", "jinja2.sandbox"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(
        ImportError,
        match=r"chat templates need jinja2 \(>=3.1.6\): pip install -e '.\[tokenizers\]'",
    ):
        chat.render("{{ 'not compiled before' }}", [[USER]])
    with pytest.raises(ImportError, match=r"'.\[serve\]' for paxkv-serve"):
        template_sandbox.require_jinja2()


def test_the_server_names_its_flag_and_answers_400_without_jinja2(tmp_path, monkeypatch):
    pytest.importorskip("starlette")
    import dataclasses
    import sys

    from paxkv.models import load_tokenizer
    from paxkv.serve import protocol

    named = [{"name": "a", "template": LLAMA3}, {"name": "b", "template": CHATML}]
    write_tokenizer(tmp_path, named)
    python = chat.ChatTemplates.from_checkpoint(str(tmp_path), "tokenizer_config.json")
    server = dataclasses.replace(python, knob="--chat_template=")
    with pytest.raises(ValueError, match=r"none named 'default': pass --chat_template= one of"):
        server.get()
    none = dataclasses.replace(chat.ChatTemplates({}, {}, "tiny-py"), knob="--chat_template=")
    with pytest.raises(ValueError, match=r"no chat template .*pass --chat_template=<a Jinja"):
        none.get()
    tokenizer = load_tokenizer(tmp_path)
    body = {"messages": [USER], "chat_template": "{{ 'compiled nowhere else' }}"}
    for name in ("jinja2", "jinja2.ext", "jinja2.sandbox"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(protocol.ApiError) as e:
        protocol.chat_prompt(
            body,
            server,
            tokenizer,
            max_model_len=512,
            limits=protocol.Limits(trust_request_chat_template=True),
        )
    assert e.value.status == 400 and e.value.param == "chat_template"
    assert "chat templates need jinja2" in e.value.message and "'.[serve]'" in e.value.message
