//! The router renders a chat request's prompt byte for byte as the engines do, or its prefix
//! hashes never match the engine's KV events: tools, assistant tool calls (arguments as JSON
//! text), tool results, extra message fields, `chat_template_kwargs` (`enable_thinking`),
//! `reasoning_effort`, `add_generation_prompt`, non-ASCII text, and the server-side defaults of
//! `--kv-default-chat-template-kwargs`. The reference is `tests/peers/hf_chat_render.py`:
//! Hugging Face's template environment in jinja2, fed as vLLM feeds it (`cargo xtask test`
//! installs jinja2).

use infera_adapters::tokenize::{ChatExtras, ChatMessage, ChatTemplate, TemplateKwargs};
use serde_json::{Value, json};
use std::io::{BufRead as _, BufReader, Write as _};
use std::path::Path;
use std::process::{Command, Stdio};

/// A tool-calling template in the style of today's open models (written for this test): tools
/// as JSON lines in the system turn, assistant tool calls with their arguments as JSON, tool
/// results, a thinking switch and an effort line.
const TEMPLATE: &str = r#"{%- if tools %}
<|im_start|>system
{%- if messages[0].role == 'system' %}
{{ messages[0].content }}

{% endif %}
# Tools
<tools>
{%- for tool in tools %}
{{ "\n" }}{{ tool | tojson }}
{%- endfor %}
</tools>
{{ tools[0].function.parameters | tojson(indent=2) }}<|im_end|>
{%- elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'assistant' and message.tool_calls %}
<|im_start|>assistant
{{ message.content }}
{%- if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
{%- for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{%- elif message.role == 'tool' %}
<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">{{ message.content }}</tool_response><|im_end|>
{%- else %}
<|im_start|>{{ message.role }}{% if message.name is defined %} ({{ message.name }}){% endif %}

{{ message.content }}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{%- if enable_thinking is defined and enable_thinking is false %}
<think>

</think>
{%- endif %}
{%- if reasoning_effort is defined %}
Reasoning: {{ reasoning_effort }}
{%- endif %}
{%- endif %}"#;

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather",
            "description": "Le temps qu'il fait — à Paris, \"now\".",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                "scale": {"enum": ["C", "F"]}, "threshold": {"type": "number", "default": 0.5}},
                "required": ["city"]}}},
        {"type": "function", "function": {"name": "lookup", "parameters": {}}},
    ])
}

/// The requests compared, each a chat body as a client sends it.
fn requests() -> Vec<Value> {
    let agent_turn = json!([
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": "Weather in Paris for 3 days?"},
        {"role": "assistant", "content": null, "reasoning_content": "Need the tool.",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 3, \"scale\": \"C\"}"}},
                {"id": "call_2", "type": "function", "function": {"name": "lookup", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, clear"},
        {"role": "tool", "tool_call_id": "call_2", "content": "nothing"},
    ]);
    vec![
        json!({"messages": [{"role": "user", "content": "What is 2+2?"}]}),
        json!({"messages": [{"role": "user", "name": "ana", "content": [
            {"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}]}),
        json!({"messages": agent_turn, "tools": tools()}),
        json!({"messages": agent_turn, "tools": tools(),
            "chat_template_kwargs": {"enable_thinking": false}}),
        json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"}),
        json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low",
            "chat_template_kwargs": {"reasoning_effort": "high"}}),
        json!({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false}),
    ]
}

/// The reference renderer, one request per line.
struct Reference {
    child: std::process::Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Reference {
    fn start() -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/peers/hf_chat_render.py");
        let mut child = Command::new("python3")
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 runs the reference renderer");
        let lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        Self { child, lines }
    }

    fn render(&mut self, request: &Value) -> String {
        let job = json!({"template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>",
            "request": request});
        let stdin = self.child.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{job}").expect("job written");
        let line = self
            .lines
            .next()
            .expect("an answer (install jinja2: `python3 -m pip install jinja2`)")
            .expect("a line");
        let answer: Value = serde_json::from_str(&line).expect("json");
        match answer["text"].as_str() {
            Some(text) => text.to_owned(),
            None => panic!("the reference failed on {request}: {}", answer["error"]),
        }
    }
}

impl Drop for Reference {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The request as the router reads it.
fn ours(request: &Value) -> (Vec<ChatMessage>, ChatExtras) {
    let messages = serde_json::from_value(request["messages"].clone()).expect("messages");
    let extras = serde_json::from_value(request.clone()).expect("extras");
    (messages, extras)
}

#[test]
fn chat_requests_render_as_the_engines_render_them() {
    let template = ChatTemplate::new(
        TEMPLATE.into(),
        Some("<s>".into()),
        Some("</s>".into()),
        "test",
    )
    .expect("compiles");
    let mut reference = Reference::start();
    for request in requests() {
        let (messages, extras) = ours(&request);
        let rendered = template.render(&messages, &extras).expect("renders");
        assert_eq!(rendered, reference.render(&request), "{request}");
    }
}

#[test]
fn server_side_defaults_are_merged_as_the_engine_merges_them() {
    let template = ChatTemplate::new(TEMPLATE.into(), None, None, "test").expect("compiles");
    let mut reference = Reference::start();
    let defaults: TemplateKwargs =
        serde_json::from_value(json!({"enable_thinking": false, "reasoning_effort": "high"}))
            .expect("kwargs");
    // What the engine renders: the defaults under the request's own kwargs, and their effort
    // when the request names none.
    let cases = [
        (
            json!({"messages": [{"role": "user", "content": "hi"}]}),
            json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high",
                "chat_template_kwargs": {"enable_thinking": false, "reasoning_effort": "high"}}),
        ),
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low",
                "chat_template_kwargs": {"enable_thinking": true}}),
            json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low",
                "chat_template_kwargs": {"enable_thinking": true, "reasoning_effort": "high"}}),
        ),
    ];
    for (request, merged) in cases {
        let (messages, mut extras) = ours(&request);
        extras.with_defaults(&defaults);
        let rendered = template.render(&messages, &extras).expect("renders");
        assert_eq!(rendered, reference.render(&merged), "{request}");
    }
    // Without defaults, the first request renders differently: the flag matters.
    let (messages, extras) = ours(&json!({"messages": [{"role": "user", "content": "hi"}]}));
    let plain = template.render(&messages, &extras).expect("renders");
    assert!(!plain.contains("<think>"), "{plain}");
}
