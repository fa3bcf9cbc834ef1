//! The front's tokenizer as the request service's [`Tokenize`] port: a parsed [`Input`] is
//! tokenized on the blocking pool, a chat rendered with `--chat-template` (or the tokenizer's
//! own) and the template defaults its engines merge in (`--kv-default-chat-template-kwargs`),
//! or, for the workers whose SGLang engine merges others (`--kv-per-worker-template-kwargs`,
//! see `variants`), with theirs.

use super::ServerState;
use super::http::Input;
use crate::tokenize::{ChatMessage, TemplateKwargs, TokenizeError};
use async_trait::async_trait;
use infera_core::ports::tokenize::{self as port, Rendering, Tokenize};
use std::sync::Arc;

#[async_trait]
impl Tokenize for ServerState {
    type Prompt = Input;
    type Rendering = Arc<TemplateKwargs>;

    fn multimodal(&self, prompt: &Input) -> bool {
        matches!(prompt, Input::Chat(messages, _) if messages.iter().any(ChatMessage::has_non_text))
    }

    fn renderings(&self, prompt: &Input, model: &str) -> Vec<Rendering<Arc<TemplateKwargs>>> {
        match prompt {
            Input::Chat(..) => self.differing_renderings(model),
            Input::Text(_) | Input::Tokens(_) => Vec::new(),
        }
    }

    async fn tokenize(
        &self,
        prompt: Input,
        rendering: Option<Arc<TemplateKwargs>>,
    ) -> Result<Vec<u32>, port::TokenizeError> {
        let tokenizer = self.inner.tokenizer.clone();
        let template = self.inner.options.chat_template.clone();
        let defaults = rendering.unwrap_or_else(|| self.inner.options.template_defaults.clone());
        let joined = tokio::task::spawn_blocking(move || match prompt {
            Input::Tokens(ids) => Ok(ids),
            Input::Text(text) => tokenizer.encode(&text),
            Input::Chat(messages, mut extras) => {
                extras.with_defaults(&defaults);
                tokenizer.encode_chat(&messages, &extras, template.as_deref())
            }
        })
        .await
        .map_err(|e| port::TokenizeError::Failed(format!("tokenizer task failed: {e}")))?;
        joined.map_err(|e| match e {
            TokenizeError::Template(t) => {
                port::TokenizeError::Refused(format!("chat template: {t}"))
            }
            other => port::TokenizeError::Failed(other.to_string()),
        })
    }
}
