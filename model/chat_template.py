r"""minimind's chat format (Qwen3 style) as a Jinja template, for transformers' `apply_chat_template`.

The Hugging Face export writes CHAT_TEMPLATE into tokenizer_config.json. A conversation renders as
(the system turn only when there is a system message or tools):

    <|im_start|>system\n{system}\n\n# Tools ... <tools>\n{one function spec per line}\n</tools> ...<|im_end|>\n
    <|im_start|>user\n{content}<|im_end|>\n
    <|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{content}
        \n<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n{result}\n</tool_response>\n<tool_response>...<|im_end|>\n

Consecutive `tool` messages share one `user` turn. Every assistant turn has a think block (empty
when there is no reasoning), so a model learns to open one. Training renders the same text in
Python (dataset/chat_format.py), to insert the tags by id; tests/test_sft_schema.py holds the two equal.
"""

# Tags of the format. A tokenizer that has one of them as a token of its own (minimind's has the
# think, tool_call and tool_response ones) gets that token; otherwise the tag is ordinary text.
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>",
        "<tool_response>", "</tool_response>", "<tools>", "</tools>")
TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

# Every tag opens with "{%-" or "{{-", so the newlines and indentation between them are not output.
# transformers' `tojson` is json.dumps with ensure_ascii=False, as dataset/chat_format.py writes JSON.
_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- 'TOOLS_INTRO' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- 'TOOLS_OUTRO<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {#- Without reasoning_content, a "<think>...</think>" block opening the content is the reasoning. #}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if message.reasoning_content is not string and '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- if message.tool_calls is string %}
            {{- raise_exception('tool_calls must be a list; dataset/chat_format.parse_conversation parses JSON') }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- if not loop.first or content %}{{- '\n' }}{%- endif %}
            {%- if call.function is mapping %}{%- set call = call.function %}{%- endif %}
            {{- '<tool_call>\n{"name": ' + (call.name | tojson) + ', "arguments": ' }}
            {{- call.arguments if call.arguments is string else (call.arguments | tojson) }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
# The tools texts, written once above, go into the template's quoted strings with their newlines escaped.
CHAT_TEMPLATE = (_TEMPLATE.replace("TOOLS_INTRO", TOOLS_INTRO.replace("\n", r"\n"))
                 .replace("TOOLS_OUTRO", TOOLS_OUTRO.replace("\n", r"\n")))
