//! The front's tokenizers as the request service's [`Tokenize`] port: a parsed [`Input`] is
//! tokenized on the blocking pool with its base model's tokenizer (`--model-tokenizer`, else the
//! default one), a chat rendered with `--chat-template` (or the tokenizer's own) and the template defaults its engines merge in (`--kv-default-chat-template-kwargs`),
//! or, for the workers whose SGLang engine merges others (`--kv-per-worker-template-kwargs`,
//! see `variants`), with theirs. A chat's images are keyed as the model's engines key them
//! ([`Tokenizer::keyed_images`]): their placeholders expanded, their runs named.

use super::ServerState;
use super::http::Input;
use crate::tokenize::{ChatTemplate, TemplateKwargs, TokenizeError, Tokenizer};
use async_trait::async_trait;
use infera_core::ports::tokenize::{self as port, Rendering, Tokenize, Tokens};
use std::sync::Arc;

#[async_trait]
impl Tokenize for ServerState {
    type Prompt = Input;
    type Rendering = Arc<TemplateKwargs>;

    fn unkeyed(&self, prompt: &Input, model: &str) -> bool {
        match prompt {
            Input::Chat(messages, _) => {
                let (tokenizer, template) = self.tokenizer_of(model);
                tokenizer
                    .keyed_images(messages, template.as_deref())
                    .is_none()
            }
            Input::Text(_) | Input::Tokens(_) => false,
        }
    }

    fn renderings(&self, prompt: &Input, model: &str) -> Vec<Rendering<Arc<TemplateKwargs>>> {
        match prompt {
            Input::Chat(..) => self.differing_renderings(model),
            Input::Text(_) | Input::Tokens(_) => Vec::new(),
        }
    }

    async fn tokenize(
        &self,
        model: &str,
        prompt: Input,
        rendering: Option<Arc<TemplateKwargs>>,
    ) -> Result<Tokens, port::TokenizeError> {
        let (tokenizer, template) = self.tokenizer_of(model);
        let defaults = rendering.unwrap_or_else(|| self.inner.options.template_defaults.clone());
        let joined = tokio::task::spawn_blocking(move || match prompt {
            Input::Tokens(ids) => Ok(Tokens::from(ids)),
            Input::Text(text) => tokenizer.encode(&text).map(Tokens::from),
            Input::Chat(messages, mut extras) => {
                extras.with_defaults(&defaults);
                let template = template.as_deref();
                let images = tokenizer
                    .keyed_images(&messages, template)
                    .unwrap_or_default();
                tokenizer
                    .encode_chat_keyed(&messages, &extras, template, &images)
                    .map(|(ids, mm)| Tokens { ids, mm })
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

impl ServerState {
    /// Base model `model`'s tokenizer and the template that overrides its own: a model with its
    /// own tokenizer renders chats with that tokenizer's template; `--chat-template` overrides
    /// the default tokenizer's only.
    fn tokenizer_of(&self, model: &str) -> (Arc<Tokenizer>, Option<Arc<ChatTemplate>>) {
        match self.inner.options.model_tokenizers.get(model) {
            Some(own) => (Arc::clone(own), None),
            None => (
                self.inner.tokenizer.clone(),
                self.inner.options.chat_template.clone(),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{record, state_with_models};
    use super::*;
    use crate::tokenize::Tokenizer;
    use infera_core::event::{Engine, WorkerRecord};
    use infera_core::ids::WorkerId;
    use infera_core::service::RequestKeys;
    use std::collections::BTreeMap;

    /// A word-level tokenizer of three words, another model's than the fixture's.
    fn tiny() -> Tokenizer {
        let dir = tempfile::tempdir().expect("tempdir");
        let json = r#"{"version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [], "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2},
                      "unk_token": "[UNK]"}}"#;
        let file = dir.path().join("tokenizer.json");
        std::fs::write(&file, json).expect("write");
        Tokenizer::from_path(&file).expect("tiny tokenizer")
    }

    #[tokio::test]
    async fn each_base_model_and_its_adapters_use_the_models_own_tokenizer() {
        let models = BTreeMap::from([("small".to_owned(), Arc::new(tiny()))]);
        let st = state_with_models(models);
        st.register_worker(record("a"));
        let mut small = WorkerRecord::mixed(
            WorkerId::new("b"),
            "http://b".into(),
            "small",
            Engine::Vllm,
            16,
        );
        small.set_lora_adapters(&["small-sql".to_owned()]);
        st.register_worker(small);
        let tokens = |model: &'static str| {
            let st = st.clone();
            async move {
                let text = Input::Text("hello world hello".into());
                st.service()
                    .prepare(&st, "k#1", model.into(), text, RequestKeys::default())
                    .await
                    .expect("prepared")
                    .tokens
            }
        };
        assert_eq!(tokens("small").await, [1, 2, 1]);
        assert_eq!(
            tokens("small-sql").await,
            [1, 2, 1],
            "an adapter uses its base's"
        );
        let default = st
            .inner
            .tokenizer
            .encode("hello world hello")
            .expect("encode");
        assert_eq!(tokens("m").await, default);
        assert_ne!(default, [1, 2, 1]);
    }
}
