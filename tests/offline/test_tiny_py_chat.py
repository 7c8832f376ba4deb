"""The default model chats out of the box: tiny-py ships a chat template (its
tokenizer_config.json), which renders a conversation as Python comments."""

from paxkv import LLM, SamplingParams


def test_tiny_py_chats_with_its_own_template():
    llm = LLM("tiny-py", warmup=False, max_model_len=256)
    assert sorted(llm.chat_templates.templates) == ["default"]
    conversation = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "add two numbers"},
    ]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    (out,) = llm.chat(conversation, greedy, use_tqdm=False)
    assert out.prompt == "# system: You write Python.\n# user: add two numbers\n# assistant:\n"
    (ref,) = llm.generate(out.prompt, greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
