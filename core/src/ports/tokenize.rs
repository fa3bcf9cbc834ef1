//! The tokenizer port: a prompt as a request carried it (text, token ids, or a chat that a
//! template renders) turned into the token ids an engine computes its KV cache over. The
//! request service tokenizes through it before it hashes ([`Service::prepare`]); the server
//! front's tokenizer and chat templates (`infera-adapters`) implement it, and decide what a
//! prompt is, so the service needs no API's body shapes.
//!
//! # Multimodal prompts
//! An image becomes a run of placeholder tokens whose blocks the engine keys by the image's
//! identifier ([`MmRun`]); the tokenizer expands the runs as the engine does and names them
//! ([`Tokens::mm`]). A prompt with a part it cannot key that way ([`Tokenize::unkeyed`]) is
//! routed by load alone.
//!
//! # Renderings
//! A chat is rendered by each engine with the chat-template defaults it merges in. Workers whose
//! engine merges other defaults than the fleet's ([`Tokenize::renderings`]) get the prompt's ids
//! rendered their way too, and are routed on those.
//!
//! [`Service::prepare`]: crate::service::Service::prepare

use crate::error::{ErrorCode, ServiceError};
use crate::hashing::identity::MmRun;
use crate::ids::WorkerId;
use async_trait::async_trait;

/// Why a prompt could not be tokenized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenizeError {
    /// The prompt is one the chat template refuses: the client's to fix (400).
    #[error("{0}")]
    Refused(String),
    /// The tokenizer failed (500).
    #[error("{0}")]
    Failed(String),
}

impl ServiceError for TokenizeError {
    fn code(&self) -> ErrorCode {
        match self {
            TokenizeError::Refused(_) => ErrorCode::BadRequest,
            TokenizeError::Failed(_) => ErrorCode::Internal,
        }
    }
}

/// A prompt's token ids as the engine computes its KV cache over them, and its multimodal
/// items' runs among them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tokens {
    pub ids: Vec<u32>,
    /// Sorted by offset, not overlapping.
    pub mm: Vec<MmRun>,
}

impl From<Vec<u32>> for Tokens {
    fn from(ids: Vec<u32>) -> Self {
        Self {
            ids,
            mm: Vec::new(),
        }
    }
}

/// Workers that render a chat another way: how, and each one's KV block size.
pub type Rendering<R> = (R, Vec<(WorkerId, u32)>);

/// Tokenizes prompts the way the fleet's engines do. See the module docs.
#[async_trait]
pub trait Tokenize: Send + Sync {
    /// A prompt as an edge parsed it.
    type Prompt: Clone + Send + 'static;
    /// How a chat is rendered (the template defaults an engine merges in).
    type Rendering: Send + 'static;

    /// Whether the prompt holds parts the router cannot key as base model `model`'s engines do
    /// (audio, a remote image, an image for a model whose placeholder expansion it does not
    /// know), so it is routed by load alone.
    fn unkeyed(&self, prompt: &Self::Prompt, model: &str) -> bool;

    /// The workers of `model` that render `prompt` another way than the default, grouped by
    /// rendering; empty for a prompt that is not a chat.
    fn renderings(&self, prompt: &Self::Prompt, model: &str) -> Vec<Rendering<Self::Rendering>>;

    /// The prompt's token ids with base model `model`'s tokenizer (a fleet may serve several
    /// base models, each tokenized its own way), rendered the default way (`None`) or as
    /// `rendering` says, with its multimodal runs expanded. Runs off the async workers.
    ///
    /// # Errors
    /// [`TokenizeError`].
    async fn tokenize(
        &self,
        model: &str,
        prompt: Self::Prompt,
        rendering: Option<Self::Rendering>,
    ) -> Result<Tokens, TokenizeError>;
}
