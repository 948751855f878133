"""The chat template fields (``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``) and
``--chat-template FILE``: what the model is given, and the 400s naming the field."""

from __future__ import annotations

import pytest

from server import cli
from server.app import create_app
from server.config import ConfigError
from server.text import read_chat_template
from tests.server.conftest import make_config
from tests.server.helpers import Script, ScriptedDecoder, chat_body, running_app, token_steps

STORY = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
SHOUTING = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if shout %}LOUD{% endif %}"


@pytest.fixture
def scripted(tokenizer):
    return ScriptedDecoder(tokenizer, lambda text: Script(token_steps(tokenizer, [" time"])))


@pytest.fixture
async def client(scripted):
    async with running_app(make_config(), scripted) as (_, client):
        yield client


async def rendered(client, tokenizer, **body) -> str:
    response = await client.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return tokenizer.decode(response.json()["tokens"])


async def test_continue_final_message_ends_inside_the_assistant_turn(client, tokenizer):
    text = await rendered(client, tokenizer, messages=STORY, **CONTINUE)
    assert text.endswith("<|im_start|>assistant\nOnce upon a")
    closed = await rendered(client, tokenizer, messages=STORY, add_generation_prompt=False)
    assert closed.endswith("Once upon a<|im_end|>\n")
    opened = await rendered(client, tokenizer, messages=STORY)
    assert opened.endswith("<|im_end|>\n<|im_start|>assistant\n")
    chat = await client.post("/v1/chat/completions", json={"messages": STORY, "max_tokens": 1, **CONTINUE})
    assert chat.status_code == 200
    assert chat.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("fields, param", [
    ({"continue_final_message": True}, "continue_final_message"),
    ({**CONTINUE, "messages": STORY[:1]}, "messages[0].role"),
    ({**CONTINUE, "messages": [STORY[0], {"role": "assistant", "content": ""}]}, "messages[1].content"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"continue_final_message": 1}, "continue_final_message"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
async def test_bad_template_fields_are_400_naming_the_field(client, path, fields, param):
    body = {"messages": STORY, **fields}
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_a_template_file_replaces_the_models_and_takes_its_variables(tmp_path, scripted, tokenizer):
    template = tmp_path / "shout.jinja"
    template.write_text(SHOUTING)
    async with running_app(make_config(chat_template=str(template)), scripted) as (_, client):
        messages = [{"role": "user", "content": "hi"}]
        assert await rendered(client, tokenizer, messages=messages) == "user: hi\n"
        loud = await rendered(client, tokenizer, messages=messages, chat_template_kwargs={"shout": True})
        assert loud == "user: hi\nLOUD"
        chat = await client.post("/v1/chat/completions", json=chat_body("hi", chat_template_kwargs={"shout": 1}))
        assert chat.status_code == 200
        unread = await rendered(client, tokenizer, messages=messages, chat_template_kwargs={"enable_thinking": False})
        assert unread == "user: hi\n"  # a key the template does not read changes nothing, as in vLLM
        refused = await client.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"bos_token": 1}})
        assert refused.status_code == 400 and "shout" in refused.json()["error"]["message"]


@pytest.mark.parametrize("content, reason", [
    (None, "cannot read the chat template"), ("{% if %}", "is not valid Jinja"), (" \n", "is empty"),
])
def test_a_bad_template_file_fails_at_start_up(tmp_path, capsys, content, reason):
    path = tmp_path / "template.jinja"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=reason):
        read_chat_template(str(path))
    with pytest.raises(ConfigError, match=reason):
        create_app(make_config(chat_template=str(path)), load_decoder=lambda config: None)
    assert cli.main(["serve", "--device", "cpu", "--chat-template", str(path)]) == 2
    assert reason in capsys.readouterr().err
