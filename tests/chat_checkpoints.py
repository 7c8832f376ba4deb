"""Checkpoint directories with a BPE tokenizer and real models' chat templates, and
transformers' rendering of them: the oracle of the chat tests (tests/text, tests/offline)."""

import json

SPECIALS = [
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "</s>",
]
BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"

# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2.5's ChatML template (its tool-calling branches cut), with trim_blocks and
# lstrip_blocks at work on the indented, multi-line layout; `tools` must be None.
CHATML = """{%- if tools %}
    {{- '<|im_start|>system\\n' + (tools | tojson) + '<|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Mistral-7B-Instruct-v0.1's template, verbatim: it raises on a bad role or order.
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)
# transformers' tojson (no HTML escaping, non-ASCII kept), a kwarg, loop controls and
# the {% generation %} block.
JSONISH = (
    "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
    "{% generation %}{{ m | tojson }}{% endgeneration %}\n{% endfor %}"
    "{{ {'style': style, 'n': messages | length} | tojson(indent=2, sort_keys=True) }}"
    "{% if add_generation_prompt %}>{% endif %}"
)

SYSTEM = {"role": "system", "content": "You are a helpful assistant. "}
USER = {"role": "user", "content": "Hello, how are you?"}
ASSISTANT = {"role": "assistant", "content": "I am fine, thanks."}
USER2 = {"role": "user", "content": '  And <b>you</b> & "me" — café?\n'}
CONVERSATIONS = [
    [USER],
    [SYSTEM, USER],
    [SYSTEM, USER, ASSISTANT, USER2],
    [USER, ASSISTANT, USER2],
]


def write_tokenizer(directory, chat_template, **config) -> None:
    """A byte-level BPE tokenizer.json (BOS added by its post-processor) and its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [m["content"] for m in (SYSTEM, USER, ASSISTANT, USER2)] + ["system user assistant"]
    tok.train_from_iterator(corpus * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    added_bos = {"__type": "AddedToken", "content": BOS, "lstrip": False, "normalized": False}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": added_bos,  # as older checkpoints write it
        "eos_token": EOS,
        "chat_template": chat_template,
        **config,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def transformers_side(directory, conversations, **kwargs):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    texts = [tok.apply_chat_template(c, tokenize=False, **kwargs) for c in conversations]
    ids = [
        tok.apply_chat_template(c, tokenize=True, return_dict=False, **kwargs)
        for c in conversations
    ]
    return texts, [list(i) for i in ids]
