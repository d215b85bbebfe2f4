"""Chat templates of the text families the replicas copy, written to render what each model's own
template renders (a chat template is the model's data format, so the strings must match).

Each template was checked against the family's published template for the cases the tests render:
plain chats, a system message, the `tools=` branch, assistant tool calls and `tool` results.
Behaviour worth knowing, kept on purpose because the real templates do it:

  QWEN25   ChatML; without a system message it inserts Qwen's default one; with `tools` the system
           turn lists the schemas in <tools></tools> (one `tojson` line each) and the Hermes call
           format; assistant `tool_calls` render as <tool_call> JSON blocks; consecutive `tool`
           messages share ONE user turn, each in <tool_response></tool_response>.
  QWEN3    as Qwen2.5 without a default system message; assistant turns after the last real user
           query keep their reasoning as <think>...</think> (earlier ones drop it);
           `enable_thinking=False` appends an empty think block to the generation prompt.
  LLAMA3   Llama 3.1 / 3.2 Instruct: <|begin_of_text|>, header ids, <|eot_id|>; the system turn
           always carries the knowledge-cutoff and date lines; `tools` (with the default
           tools_in_user_message) go into the first user turn as indented JSON; a tool call renders
           as {"name": ..., "parameters": ...} (one call per message, more raise); `tool` /
           `ipython` messages render in an `ipython` turn with the content passed through
           `tojson` when it is iterable (a str IS iterable in Jinja, so a str result is quoted).
  MISTRAL  Mistral-7B-Instruct-v0.3: [INST] ... [/INST]; tools as [AVAILABLE_TOOLS] before the LAST
           user message; the system message is folded into the last user message only when that
           message is the last one (otherwise it is dropped, as the real template does); calls as
           [TOOL_CALLS] [...] with 9-character ids; results as [TOOL_RESULTS] {...}[/TOOL_RESULTS].
           The template is not append-only (rollouts fold the system prompt into the first user
           message and keep a single user message per episode).
  GEMMA2   gemma-2-*-it: <bos>, <start_of_turn>user / model, <end_of_turn>; a system message raises
           "System role not supported", roles must alternate user / model (a `tool` message after
           an assistant turn raises), contents are trimmed, `tools=` is ignored.
  PHI3     Phi-3-mini-4k-instruct: <|system|> / <|user|> / <|assistant|> ... <|end|>; `tools=`,
           assistant `tool_calls` and `tool` messages are dropped without a word (the template
           renders only the three roles); without the generation prompt it ends with the EOS text.
"""

from __future__ import annotations

QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# The tools preamble shared by Qwen2.5 and Qwen3 (the Hermes function-calling prompt).
_QWEN_TOOLS_HEAD = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_QWEN_TOOLS_TAIL = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n'
)

# A tool message inside ChatML: consecutive tool messages share one user turn.
_QWEN_TOOL_MESSAGE = """
{%- elif message.role == "tool" -%}
  {%- if loop.first or messages[loop.index0 - 1].role != "tool" -%}{{ '<|im_start|>user' }}{%- endif -%}
  {{ '\\n<tool_response>\\n' ~ content ~ '\\n</tool_response>' }}
  {%- if loop.last or messages[loop.index0 + 1].role != "tool" -%}{{ '<|im_end|>\\n' }}{%- endif -%}
"""

# One <tool_call> block per call; `arguments` may be a dict (tojson) or an already-JSON string.
_QWEN_CALLS = """
  {%- for call in message.tool_calls or [] -%}
    {%- set fn = call.function if call.function else call -%}
    {%- if not loop.first or content -%}{{ '\\n' }}{%- endif -%}
    {{ '<tool_call>\\n{"name": "' ~ fn.name ~ '", "arguments": ' }}
    {%- if fn.arguments is string -%}{{ fn.arguments }}{%- else -%}{{ fn.arguments | tojson }}{%- endif -%}
    {{ '}\\n</tool_call>' }}
  {%- endfor -%}
"""

QWEN25 = (
    """{%- if tools -%}
  {{ '<|im_start|>system\\n' }}
  {%- if messages[0].role == 'system' -%}{{ messages[0].content }}{%- else -%}{{ '"""
    + QWEN25_DEFAULT_SYSTEM
    + """' }}{%- endif -%}
  {{ "\\n\\n"""
    + _QWEN_TOOLS_HEAD
    + """" }}
  {%- for tool in tools -%}{{ '\\n' ~ (tool | tojson) }}{%- endfor -%}
  {{ \""""
    + _QWEN_TOOLS_TAIL
    + """" }}
{%- elif messages[0].role == 'system' -%}
  {{ '<|im_start|>system\\n' ~ messages[0].content ~ '<|im_end|>\\n' }}
{%- else -%}
  {{ '<|im_start|>system\\n"""
    + QWEN25_DEFAULT_SYSTEM
    + """<|im_end|>\\n' }}
{%- endif -%}
{%- for message in messages -%}
  {%- set content = message.content -%}
  {%- if message.role == "user" or (message.role == "system" and not loop.first)
        or (message.role == "assistant" and not message.tool_calls) -%}
    {{ '<|im_start|>' ~ message.role ~ '\\n' ~ content ~ '<|im_end|>\\n' }}
  {%- elif message.role == "assistant" -%}
    {{ '<|im_start|>assistant' }}
    {%- if content -%}{{ '\\n' ~ content }}{%- endif -%}
    {%- for call in message.tool_calls -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {{ '\\n<tool_call>\\n{"name": "' ~ fn.name ~ '", "arguments": ' ~ (fn.arguments | tojson) ~ '}\\n</tool_call>' }}
    {%- endfor -%}
    {{ '<|im_end|>\\n' }}"""
    + _QWEN_TOOL_MESSAGE
    + """{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}
"""
)

QWEN3 = (
    """{%- if tools -%}
  {{ '<|im_start|>system\\n' }}
  {%- if messages[0].role == 'system' -%}{{ messages[0].content ~ '\\n\\n' }}{%- endif -%}
  {{ \""""
    + _QWEN_TOOLS_HEAD
    + """" }}
  {%- for tool in tools -%}{{ '\\n' ~ (tool | tojson) }}{%- endfor -%}
  {{ \""""
    + _QWEN_TOOLS_TAIL
    + """" }}
{%- elif messages[0].role == 'system' -%}
  {{ '<|im_start|>system\\n' ~ messages[0].content ~ '<|im_end|>\\n' }}
{%- endif -%}
{#- the last real user query: a user message that is not a wrapped tool response -#}
{%- set ns = namespace(searching=true, last_query=messages | length - 1) -%}
{%- for message in messages | reverse -%}
  {%- if ns.searching and message.role == "user" and message.content is string
        and not (message.content.startswith('<tool_response>')
                 and message.content.endswith('</tool_response>')) -%}
    {%- set ns.searching = false -%}
    {%- set ns.last_query = messages | length - loop.index -%}
  {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
  {%- set content = message.content if message.content is string else '' -%}
  {%- if message.role == "user" or (message.role == "system" and not loop.first) -%}
    {{ '<|im_start|>' ~ message.role ~ '\\n' ~ content ~ '<|im_end|>\\n' }}
  {%- elif message.role == "assistant" -%}
    {%- set reasoning = '' -%}
    {%- if message.reasoning_content is string -%}
      {%- set reasoning = message.reasoning_content -%}
    {%- elif '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
      {%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
    {%- endif -%}
    {%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
      {{ '<|im_start|>assistant\\n<think>\\n' ~ reasoning.strip('\\n') ~ '\\n</think>\\n\\n' ~ content.lstrip('\\n') }}
    {%- else -%}
      {{ '<|im_start|>assistant\\n' ~ content }}
    {%- endif -%}"""
    + _QWEN_CALLS
    + """    {{ '<|im_end|>\\n' }}"""
    + _QWEN_TOOL_MESSAGE
    + """{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{ '<|im_start|>assistant\\n' }}
  {%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}
{%- endif -%}
"""
)

_LLAMA3_CALL_FORMAT = (
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and '
    "its value}.Do not use variables.\\n\\n"
)

LLAMA3 = (
    """{{ bos_token }}
{%- if custom_tools is defined -%}{%- set tools = custom_tools -%}{%- endif -%}
{%- if tools is not defined -%}{%- set tools = none -%}{%- endif -%}
{%- if tools_in_user_message is not defined -%}{%- set tools_in_user_message = true -%}{%- endif -%}
{%- if date_string is not defined -%}
  {%- if strftime_now is defined -%}{%- set date_string = strftime_now("%d %b %Y") -%}
  {%- else -%}{%- set date_string = "26 Jul 2024" -%}{%- endif -%}
{%- endif -%}
{%- if messages[0].role == 'system' -%}
  {%- set system_message = messages[0].content | trim -%}
  {%- set messages = messages[1:] -%}
{%- else -%}
  {%- set system_message = "" -%}
{%- endif -%}
{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none -%}{{ 'Environment: ipython\\n' }}{%- endif -%}
{{ 'Cutting Knowledge Date: December 2023\\nToday Date: ' ~ date_string ~ '\\n\\n' }}
{%- if tools is not none and not tools_in_user_message -%}
  {{ 'You have access to the following functions. To call a function, please respond with JSON for a function call.' }}
  {{- '"""
    + _LLAMA3_CALL_FORMAT
    + """' }}
  {%- for t in tools -%}{{ (t | tojson(indent=4)) ~ '\\n\\n' }}{%- endfor -%}
{%- endif -%}
{{ system_message ~ '<|eot_id|>' }}
{%- if tools_in_user_message and tools is not none -%}
  {%- if messages | length == 0 -%}
    {{ raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
  {%- endif -%}
  {%- set first_user = messages[0].content | trim -%}
  {%- set messages = messages[1:] -%}
  {{ '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
  {{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n' }}
  {{- '"""
    + _LLAMA3_CALL_FORMAT
    + """' }}
  {%- for t in tools -%}{{ (t | tojson(indent=4)) ~ '\\n\\n' }}{%- endfor -%}
  {{ first_user ~ '<|eot_id|>' }}
{%- endif -%}
{%- for message in messages -%}
  {%- if message.role == 'tool' or message.role == 'ipython' -%}
    {{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
    {%- if message.content is mapping or message.content is iterable -%}{{ message.content | tojson }}
    {%- else -%}{{ message.content }}{%- endif -%}
    {{ '<|eot_id|>' }}
  {%- elif 'tool_calls' in message -%}
    {%- if message.tool_calls | length != 1 -%}
      {{ raise_exception("This model only supports single tool-calls at once!") }}
    {%- endif -%}
    {%- set fn = message.tool_calls[0].function -%}
    {{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' ~ fn.name ~ '", "parameters": ' ~ (fn.arguments | tojson) ~ '}<|eot_id|>' }}
  {%- else -%}
    {{ '<|start_header_id|>' ~ message.role ~ '<|end_header_id|>\\n\\n' ~ (message.content | trim) ~ '<|eot_id|>' }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}
"""
)

MISTRAL = """{%- if messages[0].role == 'system' -%}
  {%- set system_message = messages[0].content -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- if tools is not defined -%}{%- set tools = none -%}{%- endif -%}
{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list -%}
{#- user / assistant must alternate; tool calls and tool results do not count -#}
{%- set ns = namespace(index=0) -%}
{%- for message in loop_messages -%}
  {%- if not (message.role == 'tool' or message.role == 'tool_results'
              or (message.tool_calls is defined and message.tool_calls is not none)) -%}
    {%- if (message.role == 'user') != (ns.index % 2 == 0) -%}
      {{ raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set ns.index = ns.index + 1 -%}
  {%- endif -%}
{%- endfor -%}
{{ bos_token }}
{%- for message in loop_messages -%}
  {%- if message.role == 'user' -%}
    {%- if tools is not none and message == user_messages[-1] -%}
      {{ '[AVAILABLE_TOOLS] [' }}
      {%- for tool in tools -%}
        {%- set fn = tool.function -%}
        {{ '{"type": "function", "function": {' }}
        {%- for key, val in fn.items() if key != 'return' -%}
          {%- if val is string -%}{{ '"' ~ key ~ '": "' ~ val ~ '"' }}
          {%- else -%}{{ '"' ~ key ~ '": ' ~ (val | tojson) }}{%- endif -%}
          {%- if not loop.last -%}{{ ', ' }}{%- endif -%}
        {%- endfor -%}
        {{ '}}' }}
        {%- if not loop.last -%}{{ ', ' }}{%- else -%}{{ ']' }}{%- endif -%}
      {%- endfor -%}
      {{ '[/AVAILABLE_TOOLS]' }}
    {%- endif -%}
    {%- if loop.last and system_message is defined -%}
      {{ '[INST] ' ~ system_message ~ '\\n\\n' ~ message.content ~ '[/INST]' }}
    {%- else -%}
      {{ '[INST] ' ~ message.content ~ '[/INST]' }}
    {%- endif -%}
  {%- elif message.tool_calls is defined and message.tool_calls is not none -%}
    {{ '[TOOL_CALLS] [' }}
    {%- for call in message.tool_calls -%}
      {%- set out = call.function | tojson -%}
      {{ out[:-1] }}
      {%- if call.id is not defined or call.id | length != 9 -%}
        {{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
      {%- endif -%}
      {{ ', "id": "' ~ call.id ~ '"}' }}
      {%- if not loop.last -%}{{ ', ' }}{%- else -%}{{ ']' ~ eos_token }}{%- endif -%}
    {%- endfor -%}
  {%- elif message.role == 'assistant' -%}
    {{ ' ' ~ (message.content | trim) ~ eos_token }}
  {%- elif message.role == 'tool_results' or message.role == 'tool' -%}
    {%- if message.content is defined and message.content.content is defined -%}
      {%- set content = message.content.content -%}
    {%- else -%}
      {%- set content = message.content -%}
    {%- endif -%}
    {%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 -%}
      {{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
    {%- endif -%}
    {{ '[TOOL_RESULTS] {"content": ' ~ (content | string) ~ ', "call_id": "' ~ message.tool_call_id ~ '"}[/TOOL_RESULTS]' }}
  {%- else -%}
    {{ raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
  {%- endif -%}
{%- endfor -%}
"""

# family -> template (GPT-2 ships none: a base model)
# Qwen2-VL / Qwen2.5-VL Instruct: ChatML; without a system message the default "You are a helpful
# assistant." is inserted; a message's content is a string or a list of items, where each image
# item (type "image", or an "image" / "image_url" key) renders as <|vision_start|><|image_pad|>
# <|vision_end|> (the processor expands <|image_pad|> to the image's patch tokens), video items as
# <|video_pad|>, text items as their text; add_vision_id numbers them "Picture k: ".
QWEN2_VL = (
    "{%- set counts = namespace(image=0, video=0) -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' or 'image' in item or 'image_url' in item -%}"
    "{%- set counts.image = counts.image + 1 -%}"
    "{%- if add_vision_id -%}{{ 'Picture ' + counts.image|string + ': ' }}{%- endif -%}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'video' or 'video' in item -%}"
    "{%- set counts.video = counts.video + 1 -%}"
    "{%- if add_vision_id -%}{{ 'Video ' + counts.video|string + ': ' }}{%- endif -%}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in item -%}{{ item['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# LLaVA-1.5 (llava-hf/llava-1.5-7b-hf, the processor's template): turns as "USER: " / "ASSISTANT: "
# with no separator between them; in each message its images first ("<image>\n" each), then its
# text items, each followed by one space; a system message has no role prefix; the generation
# prompt is "ASSISTANT:" (no space). Content must be a list of items (as the real template).
LLAVA15 = (
    "{%- for message in messages -%}"
    "{%- if message['role'] != 'system' -%}{{ message['role'].upper() + ': ' }}{%- endif -%}"
    "{%- for item in message['content'] if item['type'] == 'image' -%}"
    "{{ '<image>\\n' }}"
    "{%- endfor -%}"
    "{%- for item in message['content'] if item['type'] == 'text' -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{ item['text'] + ' ' }}{%- endgeneration -%}"
    "{%- else -%}{{ item['text'] + ' ' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)


# Gemma 2 instruct (google/gemma-2-2b-it, gemma-2-9b-it: tokenizer_config.json "chat_template"),
# copied exactly: the template is the model's data format.
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

# Phi-3-mini-4k-instruct (microsoft/Phi-3-mini-4k-instruct, tokenizer_config.json
# "chat_template", May 2024 revision), copied exactly.
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


TEMPLATES: dict[str, str] = {
    "qwen2.5": QWEN25,
    "qwen3": QWEN3,
    "llama3": LLAMA3,
    "mistral": MISTRAL,
    "qwen2-vl": QWEN2_VL,
    "llava-1.5": LLAVA15,
    "gemma2": GEMMA2,
    "phi3": PHI3,
}
