"""Chat templates render exactly as transformers renders them; tokenizer ids match too."""

from __future__ import annotations

import shutil

import pytest
import transformers

from treeserve.models.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Compute 2 + 3."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! The answer is "},
    ],
]

# A template in the style real checkpoints use: loop controls, raise_exception, tojson,
# a {% generation %} block and whitespace control.
RICH_TEMPLATE = """{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}
{%- if message['role'] == 'assistant' %}<|assistant|>
{% generation %}{{ message['content'] }}{% endgeneration %}<|end|>
{% else %}<|{{ message['role'] }}|>
{{ message['content'] | trim }}<|end|>
{% endif %}
{%- if loop.index > 10 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}{{ {'n': messages | length} | tojson }}"""


def hf_tokenizer(model_dir: str):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("template", [None, RICH_TEMPLATE])
def test_render_matches_transformers(llama_dir, conversation, template):
    ours, ref = Tokenizer(llama_dir), hf_tokenizer(llama_dir)
    for gen, cont in [(True, False), (False, False), (False, True)]:
        if cont and conversation[-1]["role"] != "assistant":
            continue
        kwargs = dict(add_generation_prompt=gen, continue_final_message=cont, chat_template=template)
        expected = ref.apply_chat_template(conversation, tokenize=False, **kwargs)
        assert ours.apply_chat_template(conversation, **kwargs) == expected


def test_chat_template_jinja_file(llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer(str(tmp_path)).apply_chat_template(CONVERSATIONS[0]) == "[Compute 2 + 3.]"


def test_both_generation_flags_rejected(llama_dir):
    with pytest.raises(ValueError, match="cannot both"):
        Tokenizer(llama_dir).apply_chat_template(CONVERSATIONS[1], True, True)


def test_template_error_is_value_error(llama_dir):
    with pytest.raises(ValueError, match="bad role"):
        Tokenizer(llama_dir).apply_chat_template([{"role": "robot", "content": "x"}], chat_template=RICH_TEMPLATE)


def test_token_ids_match_transformers(llama_dir):
    ours, ref = Tokenizer(llama_dir), hf_tokenizer(llama_dir)
    for text in ["Hello world", "  spaces\n\n\ttabs", "日本語 café 🙂", "<|user|>x<|end|>", "12345 + 678"]:
        assert ours.encode(text) == ref(text)["input_ids"]
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_ids == [ref.eos_token_id]
