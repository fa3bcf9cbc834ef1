//! HF chat templates rendered with minijinja.
//!
//! A [`ChatTemplate`] owns one compiled Jinja template plus the `bos_token`/`eos_token` strings
//! from tokenizer_config.json. It renders an OpenAI chat request the way the engines' Hugging
//! Face `apply_chat_template` does, since a router that renders a different prompt never finds
//! the engine's KV blocks: `trim_blocks` and `lstrip_blocks` on, `raise_exception`, Python
//! string methods (`strip`, `split`, `startswith`, …) via minijinja-contrib's pycompat, `tojson`
//! as Python's `json.dumps` ([`super::pyjson`]); the messages with every field they carry,
//! assistant tool-call arguments parsed from their JSON text (as vLLM and SGLang do), `tools`,
//! `add_generation_prompt`, and the template kwargs ([`ChatExtras`]), maps in the order the
//! request gave them.
//!
//! Content reaches the template as vLLM 0.33 gives it (`vllm/renderers/chat_utils/
//! chat_message.py`), by the template's content format ([`ContentFormat`]): a template that
//! loops over a message's content gets a list of parts (`{"type": "text", "text": …}`, an
//! image as `{"type": "image"}`, string content as one text part, a tool's text parts joined);
//! any other gets the text parts joined with `"\n"`, and a non-text part is an error there,
//! since the router cannot place the engine's placeholder for it (the server routes such
//! requests by load without rendering them).

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::image::ImageRef;

const TEMPLATE_NAME: &str = "chat";

/// Why a chat template could not be loaded or rendered. None of these is retryable: the
/// template or the request must change.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// Neither tokenizer_config.json nor an override provided a template.
    #[error(
        "no chat template: {origin} has no `chat_template`; add one or pass --chat-template FILE"
    )]
    Missing { origin: String },
    /// `chat_template` is present but has the wrong shape.
    #[error("chat_template in {origin} is malformed: {message}")]
    Malformed { origin: String, message: String },
    /// The template file could not be read.
    #[error("cannot read chat template file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The template does not compile.
    #[error("chat template from {origin} does not compile: {message}")]
    Syntax { origin: String, message: String },
    /// Rendering failed (including `raise_exception` from the template).
    #[error("chat template from {origin} failed to render: {message}")]
    Render { origin: String, message: String },
    /// A message part the router cannot tokenize (audio, or an image for a template that
    /// takes text only).
    #[error("message {index} has a content part of type {kind:?} that this template cannot take")]
    UnsupportedContent { index: usize, kind: String },
}

/// One OpenAI chat message: its role, its content, and whatever else it carries
/// (`tool_calls`, `tool_call_id`, `name`, `reasoning_content`…), which the template sees as
/// sent (in order; `null` fields left out).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<ChatContent>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, minijinja::Value>,
}

/// What a chat request gives its template besides the messages, named as in the request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatExtras {
    /// `tools`: the function definitions, as sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<minijinja::Value>>,
    /// `chat_template_kwargs`: variables for the template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<TemplateKwargs>,
    /// `reasoning_effort`, which engines put in the template's scope too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<String>,
    /// `add_generation_prompt`: whether the template opens the assistant's turn (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_generation_prompt: Option<bool>,
}

/// Template variables by name.
pub type TemplateKwargs = BTreeMap<String, minijinja::Value>;

impl ChatExtras {
    /// Merges the server-side defaults an engine applies before it renders
    /// (`--default-chat-template-kwargs`) as SGLang does: each one the request's
    /// `chat_template_kwargs` does not set, and their `reasoning_effort` when the request has
    /// none of its own.
    pub fn with_defaults(&mut self, defaults: &TemplateKwargs) {
        if defaults.is_empty() {
            return;
        }
        let kwargs = self.chat_template_kwargs.get_or_insert_default();
        for (key, value) in defaults {
            kwargs.entry(key.clone()).or_insert_with(|| value.clone());
        }
        if self.reasoning_effort.is_none()
            && let Some(effort) = kwargs.get("reasoning_effort").and_then(|v| v.as_str())
        {
            self.reasoning_effort = Some(effort.to_owned());
        }
    }

    /// The template's extra variables: `reasoning_effort`, then `chat_template_kwargs` (which
    /// win).
    fn template_kwargs(&self) -> TemplateKwargs {
        let mut out = TemplateKwargs::new();
        if let Some(effort) = &self.reasoning_effort {
            out.insert(
                "reasoning_effort".into(),
                minijinja::Value::from(effort.as_str()),
            );
        }
        if let Some(kwargs) = &self.chat_template_kwargs {
            out.extend(kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        out
    }
}

impl ChatMessage {
    /// A message with string content.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: Some(ChatContent::Text(content.into())),
            extra: BTreeMap::new(),
        }
    }

    /// The message's parts other than text (images, audio, files).
    pub fn non_text(&self) -> impl Iterator<Item = &ContentPart> {
        let parts = match &self.content {
            Some(ChatContent::Parts(parts)) => parts.as_slice(),
            _ => &[],
        };
        parts.iter().filter(|p| p.kind != "text")
    }
}

/// OpenAI message content: a string or an array of typed parts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ChatContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One element of array content: text, or an image the router knows by its identifier and
/// size ([`ImageRef`]), or another kind it only names.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    /// An `image_url` part's image (its URL is not kept).
    #[serde(default, skip_serializing)]
    pub image_url: Option<ImageRef>,
    /// The identifier the client gave the item, which vLLM keys it by.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
}

impl ContentPart {
    /// A text part.
    pub fn text(text: impl Into<String>) -> Self {
        Self {
            kind: "text".into(),
            text: Some(text.into()),
            ..Self::default()
        }
    }

    /// For an image part the engine can key as the router does, its identifier (the client's
    /// `uuid`, else the content's) and its size as the engine turns it.
    pub fn keyed_image(&self) -> Option<(Box<str>, u32, u32)> {
        if self.kind != "image_url" {
            return None;
        }
        let image = self.image_url.as_ref()?;
        let (w, h) = image.size?;
        let id = match &self.uuid {
            Some(uuid) => Box::from(uuid.as_str()),
            None => image.content_id.clone()?,
        };
        Some((id, w, h))
    }
}

/// How a template takes message content, as vLLM detects it (`vllm/renderers/hf.py`,
/// `_detect_content_format`): a template with a loop over a message's `content` (or over a
/// variable named `content`) takes a list of parts; any other takes a string. vLLM reads the
/// template's syntax tree; this reads its `{% for … in … %}` tags, which is what that amounts to
/// for the templates models ship.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    String,
    OpenAi,
}

impl ContentFormat {
    fn detect(source: &str) -> Self {
        let loops_over_content = source.split("{%").skip(1).any(|tag| {
            let tag = tag.split("%}").next().unwrap_or_default();
            let mut words = tag
                .trim_matches(|c: char| c == '-' || c == '+')
                .split_whitespace();
            if words.next() != Some("for") {
                return false;
            }
            let Some(iter) = words.skip_while(|w| *w != "in").nth(1) else {
                return false;
            };
            let iter = iter.split('|').next().unwrap_or_default();
            iter == "content"
                || iter.ends_with(".content")
                || iter.ends_with("['content']")
                || iter.ends_with("[\"content\"]")
        });
        if loops_over_content {
            Self::OpenAi
        } else {
            Self::String
        }
    }
}

/// A compiled chat template with its special-token strings.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    format: ContentFormat,
    bos_token: Option<String>,
    eos_token: Option<String>,
    origin: String,
}

impl ChatTemplate {
    /// Compiles `source`. `origin` names where it came from, for error messages.
    pub fn new(
        source: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
        origin: impl Into<String>,
    ) -> Result<Self, TemplateError> {
        let origin = origin.into();
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TemplateError::Syntax {
                origin: origin.clone(),
                message: describe(&e),
            })?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", super::pyjson::tojson);
        env.add_function("raise_exception", |message: String| -> Result<String, _> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        });
        let format = ContentFormat::detect(&source);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| TemplateError::Syntax {
                origin: origin.clone(),
                message: describe(&e),
            })?;
        Ok(Self {
            env,
            format,
            bos_token,
            eos_token,
            origin,
        })
    }

    /// Reads and compiles a `--chat-template FILE`, with the tokenizer's special tokens.
    pub fn from_file(
        path: &Path,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TemplateError> {
        let source = std::fs::read_to_string(path).map_err(|source| TemplateError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::new(source, bos_token, eos_token, path.display().to_string())
    }

    /// Where this template came from (a file path).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// How the template takes message content.
    pub fn content_format(&self) -> ContentFormat {
        self.format
    }

    /// Renders `messages` with `extras` as Hugging Face's `apply_chat_template` does in the
    /// engines: the messages (content as the template's format takes it, assistant `tool_calls`
    /// arguments given as JSON text parsed into objects, as vLLM and SGLang do), `tools`,
    /// `add_generation_prompt` (true unless the request says otherwise), the special tokens,
    /// and the template kwargs.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        extras: &ChatExtras,
    ) -> Result<String, TemplateError> {
        use minijinja::Value as V;
        let mut flat = Vec::with_capacity(messages.len());
        for (index, message) in messages.iter().enumerate() {
            let mut fields: Vec<(String, V)> = vec![
                ("role".into(), V::from(message.role.as_str())),
                (
                    "content".into(),
                    match self.format {
                        ContentFormat::String => V::from(flatten(index, message.content.as_ref())?),
                        ContentFormat::OpenAi => as_parts(index, message)?,
                    },
                ),
            ];
            for (key, value) in &message.extra {
                if value.is_none() {
                    continue;
                }
                let value = if key == "tool_calls" && message.role == "assistant" {
                    parsed_arguments(value)
                } else {
                    value.clone()
                };
                fields.push((key.clone(), value));
            }
            flat.push(V::from_pairs(fields));
        }
        let render_err = |e: minijinja::Error| TemplateError::Render {
            origin: self.origin.clone(),
            message: describe(&e),
        };
        let mut context: BTreeMap<String, V> = extras.template_kwargs();
        for (key, value) in [
            ("messages", V::from(flat)),
            ("tools", extras.tools.clone().map_or(V::from(()), V::from)),
            (
                "add_generation_prompt",
                V::from(extras.add_generation_prompt.unwrap_or(true)),
            ),
            (
                "bos_token",
                V::from(self.bos_token.as_deref().unwrap_or("")),
            ),
            (
                "eos_token",
                V::from(self.eos_token.as_deref().unwrap_or("")),
            ),
        ] {
            context.insert(key.into(), value);
        }
        let template = self.env.get_template(TEMPLATE_NAME).map_err(render_err)?;
        template.render(context).map_err(render_err)
    }
}

/// Assistant `tool_calls` with their `function.arguments` as vLLM hands them to templates:
/// JSON text parsed (objects in their order), missing or empty arguments as `{}`; arguments
/// that are not JSON stay text.
fn parsed_arguments(calls: &minijinja::Value) -> minijinja::Value {
    use minijinja::Value as V;
    let Ok(items) = calls.try_iter() else {
        return calls.clone();
    };
    V::from(
        items
            .map(|call| {
                let Ok(function) = call.get_attr("function") else {
                    return call;
                };
                let given = function.get_attr("arguments").unwrap_or_default();
                let arguments = match given.as_str() {
                    _ if given.is_undefined() || given.is_none() => {
                        V::from_pairs(Vec::<(V, V)>::new())
                    }
                    Some("") => V::from_pairs(Vec::<(V, V)>::new()),
                    Some(text) => match serde_json::from_str::<V>(text) {
                        Ok(parsed) => parsed,
                        Err(_) => return call,
                    },
                    None => return call,
                };
                // `map` with `key` set to `with` (in its place, or last when absent).
                let replace = |map: &V, key: &str, with: V| -> V {
                    let mut pairs: Vec<(V, V)> = map
                        .try_iter()
                        .into_iter()
                        .flatten()
                        .map(|k| {
                            let v = map.get_item(&k).unwrap_or_default();
                            (k, v)
                        })
                        .collect();
                    match pairs.iter_mut().find(|(k, _)| k.as_str() == Some(key)) {
                        Some((_, v)) => *v = with,
                        None => pairs.push((V::from(key), with)),
                    }
                    V::from_pairs(pairs)
                };
                let function = replace(&function, "arguments", arguments);
                replace(&call, "function", function)
            })
            .collect::<Vec<_>>(),
    )
}

/// A message's content as a template that loops over it gets it (see the module docs).
fn as_parts(index: usize, message: &ChatMessage) -> Result<minijinja::Value, TemplateError> {
    use minijinja::Value as V;
    let text = |t: &str| V::from_pairs(vec![("type", V::from("text")), ("text", V::from(t))]);
    let parts = match &message.content {
        None => Vec::new(),
        Some(ChatContent::Text(t)) => vec![text(t)],
        Some(ChatContent::Parts(parts)) => {
            if message.role == "tool" && parts.iter().all(|p| p.kind == "text") {
                return flatten(index, message.content.as_ref()).map(V::from);
            }
            let mut out = Vec::with_capacity(parts.len());
            for part in parts {
                out.push(match (part.kind.as_str(), &part.text) {
                    ("text", Some(t)) => text(t),
                    ("image_url", _) => V::from_pairs(vec![("type", V::from("image"))]),
                    (kind, _) => {
                        return Err(TemplateError::UnsupportedContent {
                            index,
                            kind: kind.to_string(),
                        });
                    }
                });
            }
            out
        }
    };
    Ok(V::from(parts))
}

fn flatten(index: usize, content: Option<&ChatContent>) -> Result<String, TemplateError> {
    match content {
        None => Ok(String::new()),
        Some(ChatContent::Text(text)) => Ok(text.clone()),
        Some(ChatContent::Parts(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                match (part.kind.as_str(), &part.text) {
                    ("text", Some(text)) => texts.push(text.as_str()),
                    (kind, _) => {
                        return Err(TemplateError::UnsupportedContent {
                            index,
                            kind: kind.to_string(),
                        });
                    }
                }
            }
            Ok(texts.join("\n"))
        }
    }
}

fn describe(e: &minijinja::Error) -> String {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        message.push_str(": ");
        message.push_str(&inner.to_string());
        source = inner.source();
    }
    message
}

/// Reads a special token from tokenizer_config.json: a string or an `AddedToken` object.
pub(crate) fn special_token(config: &Value, key: &str) -> Option<String> {
    match config.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(map) => map.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Extracts the template source from tokenizer_config.json: `chat_template` as a string, or as a
/// list of `{name, template}` of which `"default"` is used. `Ok(None)` when absent.
pub(crate) fn template_source(
    config: &Value,
    origin: &str,
) -> Result<Option<String>, TemplateError> {
    let malformed = |message: &str| TemplateError::Malformed {
        origin: origin.to_string(),
        message: message.to_string(),
    };
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(list)) => {
            for entry in list {
                if entry.get("name").and_then(Value::as_str) == Some("default") {
                    return entry
                        .get("template")
                        .and_then(Value::as_str)
                        .map(|s| Some(s.to_string()))
                        .ok_or_else(|| {
                            malformed("the \"default\" entry has no string `template`")
                        });
                }
            }
            Err(malformed(
                "a list of templates without one named \"default\"",
            ))
        }
        Some(_) => Err(malformed("expected a string or a list of {name, template}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_form_uses_default() {
        let config = serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ]});
        assert_eq!(
            template_source(&config, "x").ok().flatten().as_deref(),
            Some("D")
        );
        let config = serde_json::json!({"chat_template": [{"name": "rag", "template": "R"}]});
        assert!(matches!(
            template_source(&config, "x"),
            Err(TemplateError::Malformed { .. })
        ));
    }

    #[test]
    fn special_tokens_from_string_or_object() {
        let config = serde_json::json!({"bos_token": "<s>", "eos_token": {"content": "</s>"}});
        assert_eq!(special_token(&config, "bos_token").as_deref(), Some("<s>"));
        assert_eq!(special_token(&config, "eos_token").as_deref(), Some("</s>"));
    }

    #[test]
    fn templates_that_loop_over_content_take_parts() {
        for (source, format) in [
            (
                "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                ContentFormat::String,
            ),
            (
                "{% for m in messages %}{%- for c in m['content'] -%}{{ c.type }}{% endfor %}{% endfor %}",
                ContentFormat::OpenAi,
            ),
            (
                "{% for p in message.content | list %}{% endfor %}",
                ContentFormat::OpenAi,
            ),
            (
                "{% for item in content %}{% endfor %}",
                ContentFormat::OpenAi,
            ),
        ] {
            assert_eq!(ContentFormat::detect(source), format, "{source}");
        }
        let t = ChatTemplate::new(
            "{% for m in messages %}{% for c in m['content'] %}[{{ c.type }}{{ c.text }}]\
             {% endfor %}{% endfor %}"
                .into(),
            None,
            None,
            "inline",
        )
        .expect("compiles");
        let mut image = ContentPart {
            kind: "image_url".into(),
            ..ContentPart::default()
        };
        image.uuid = Some("x".into());
        let parts = ChatMessage {
            role: "user".into(),
            content: Some(ChatContent::Parts(vec![image, ContentPart::text("hi")])),
            extra: BTreeMap::new(),
        };
        let rendered = t
            .render(
                &[ChatMessage::text("system", "s"), parts],
                &ChatExtras::default(),
            )
            .expect("renders");
        assert_eq!(rendered, "[texts][image][texthi]");
    }

    #[test]
    fn raise_exception_is_a_render_error() {
        let template = ChatTemplate::new(
            "{{ raise_exception('no system role') }}".into(),
            None,
            None,
            "inline",
        )
        .expect("compiles");
        let err = template.render(&[], &ChatExtras::default()).err();
        assert!(matches!(err, Some(TemplateError::Render { .. })), "{err:?}");
    }
}
