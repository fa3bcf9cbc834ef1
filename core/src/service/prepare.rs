//! A parsed request made ready to decide: its prompt tokenized through the [`Tokenize`] port
//! and hashed at every block size the model's workers use (and, for workers that render a chat
//! their own way, their rendering hashed at theirs).
//!
//! Round-robin ignores the prefix, so its requests are not tokenized at all. Nor are prompts
//! with images, audio or other non-text parts: the router cannot hash what the engine caches
//! for them, so a text prefix match could send one image's request to another image's KV; they
//! are routed by load (the Python Infera's `cache_locality_skipped{reason="multimodal"}`).

use super::Service;
use super::reply::RequestError;
use crate::event::Retention;
use crate::hashing::hash_blocks;
use crate::ids::RequestId;
use crate::policy::{PolicyKind, RouteError, RouteRequest, WorkerHashes};
use crate::ports::tokenize::{Tokenize, TokenizeError};

/// A request ready to decide: its [`RouteRequest`] and the prompt's token ids.
#[derive(Debug)]
pub struct Prepared {
    pub req: RouteRequest,
    pub tokens: Vec<u32>,
    /// Whether the prompt was tokenized (round-robin needs no prefix: not tokenized at all).
    pub tokenized: bool,
}

impl Service {
    /// Tokenizes and hashes `prompt` for a request keyed `key` (see [`Service::request_key`])
    /// to `model`, unless the policy needs no prefix and no worker is `direct`ly named. See the
    /// module docs.
    ///
    /// # Errors
    /// A model no worker serves (404); a prompt the tokenizer or chat template refuses.
    pub async fn prepare<T: Tokenize + ?Sized>(
        &self,
        tokenizer: &T,
        key: &str,
        model: String,
        prompt: T::Prompt,
        retention: Option<Retention>,
        direct: bool,
    ) -> Result<Prepared, RequestError> {
        let block_sizes: Vec<u32> = self.with_fleet(|f| {
            let mut v: Vec<u32> = f
                .workers()
                .filter(|w| w.model_name == model)
                .map(|w| w.kv_block_size)
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        });
        if block_sizes.is_empty() {
            self.metrics().decision("unknown_model");
            return Err(RequestError::of(&RouteError::UnknownModel(model)));
        }
        let multimodal = tokenizer.multimodal(&prompt);
        if multimodal {
            self.metrics().locality_skipped("multimodal");
        }
        let policy = self.inner.options.router.policy;
        let tokenized = !multimodal && (direct || policy != PolicyKind::RoundRobin);
        let (tokens, per_worker) = if tokenized {
            let renderings = tokenizer.renderings(&prompt, &model);
            let mut per_worker = WorkerHashes::default();
            for (variant, (how, workers)) in (1u32..).zip(renderings) {
                let tokens = self.tokenize(tokenizer, prompt.clone(), Some(how)).await?;
                let mut sizes: Vec<u32> = workers.iter().map(|(_, bs)| *bs).collect();
                sizes.sort_unstable();
                sizes.dedup();
                for bs in sizes {
                    let blocks = hash_blocks(&tokens, bs.max(1) as usize, None);
                    per_worker.hashes.push((variant, bs, blocks));
                }
                per_worker
                    .workers
                    .extend(workers.into_iter().map(|(worker, _)| (worker, variant)));
            }
            (self.tokenize(tokenizer, prompt, None).await?, per_worker)
        } else {
            (Vec::new(), WorkerHashes::default())
        };
        let hashes = if tokenized {
            block_sizes
                .into_iter()
                .map(|bs| (bs, hash_blocks(&tokens, bs.max(1) as usize, None)))
                .collect()
        } else {
            Vec::new()
        };
        let req = RouteRequest {
            request_id: RequestId::new(key),
            model,
            prompt_tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            hashes,
            retention,
            per_worker,
            exclude: Vec::new(),
        };
        Ok(Prepared {
            req,
            tokens,
            tokenized,
        })
    }

    /// The prompt's token ids through `tokenizer` (see [`Tokenize::tokenize`]); a failure is
    /// counted and logged.
    ///
    /// # Errors
    /// The tokenizer's, as the client's answer (400 for a prompt the template refuses).
    pub async fn tokenize<T: Tokenize + ?Sized>(
        &self,
        tokenizer: &T,
        prompt: T::Prompt,
        rendering: Option<T::Rendering>,
    ) -> Result<Vec<u32>, RequestError> {
        tokenizer
            .tokenize(prompt, rendering)
            .await
            .map_err(|e: TokenizeError| {
                self.metrics().tokenizer_failed();
                tracing::warn!(error = %e, "router tokenizer failed on a request");
                RequestError::of(&e)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;
    use crate::event::WorkerRecord;
    use crate::ids::WorkerId;
    use crate::ports::tokenize::Rendering;
    use crate::service::test_support::{record, state_with};
    use async_trait::async_trait;
    use std::sync::Mutex;

    /// A prompt is its token ids and whether it holds an image; a rendering puts its token in
    /// front. Every call is remembered.
    #[derive(Debug, Default)]
    struct Fake {
        calls: Mutex<Vec<Option<u32>>>,
        other: Vec<(u32, Vec<(WorkerId, u32)>)>,
        refuse: bool,
    }

    #[async_trait]
    impl Tokenize for Fake {
        type Prompt = (Vec<u32>, bool);
        type Rendering = u32;

        fn multimodal(&self, prompt: &Self::Prompt) -> bool {
            prompt.1
        }

        fn renderings(&self, _: &Self::Prompt, _: &str) -> Vec<Rendering<u32>> {
            self.other.clone()
        }

        async fn tokenize(
            &self,
            prompt: Self::Prompt,
            rendering: Option<u32>,
        ) -> Result<Vec<u32>, TokenizeError> {
            self.calls.lock().expect("calls").push(rendering);
            if self.refuse {
                return Err(TokenizeError::Refused("chat template: no".into()));
            }
            Ok(rendering.into_iter().chain(prompt.0).collect())
        }
    }

    fn sized(id: &str, block_size: u32) -> WorkerRecord {
        WorkerRecord {
            kv_block_size: block_size,
            ..record(id)
        }
    }

    fn prompt() -> (Vec<u32>, bool) {
        ((0..64).collect(), false)
    }

    #[tokio::test]
    async fn a_prompt_is_hashed_at_each_block_size_and_each_workers_own_rendering() {
        let st = state_with(PolicyKind::KvAware);
        st.register_worker(sized("a", 16));
        st.register_worker(sized("b", 32));
        let fake = Fake {
            other: vec![(7, vec![(WorkerId::new("b"), 32)])],
            ..Fake::default()
        };
        let p = st
            .prepare(&fake, "k#1", "m".into(), prompt(), None, false)
            .await
            .unwrap();
        assert!(p.tokenized);
        assert_eq!(p.tokens, prompt().0);
        assert_eq!(p.req.prompt_tokens, 64);
        let sizes: Vec<(u32, usize)> = p.req.hashes.iter().map(|(bs, h)| (*bs, h.len())).collect();
        assert_eq!(sizes, [(16, 4), (32, 2)]);
        // Worker b renders the prompt with a token in front: its own blocks, not the default's.
        assert_eq!(p.req.per_worker.workers, [(WorkerId::new("b"), 1)]);
        let [(1, 32, own)] = p.req.per_worker.hashes.as_slice() else {
            panic!(
                "one rendering at b's block size: {:?}",
                p.req.per_worker.hashes
            );
        };
        assert_eq!(own.len(), 2);
        assert_ne!(own[0], p.req.hashes[1].1[0]);
        let mut calls = fake.calls.lock().unwrap().clone();
        calls.sort_unstable();
        assert_eq!(calls, [None, Some(7)]);
    }

    #[tokio::test]
    async fn no_prefix_is_tokenized_for_round_robin_an_image_or_an_unknown_model() {
        let fake = Fake::default();
        let rr = state_with(PolicyKind::RoundRobin);
        rr.register_worker(record("a"));
        let p = rr
            .prepare(&fake, "k#1", "m".into(), prompt(), None, false)
            .await
            .unwrap();
        assert!(!p.tokenized && p.req.hashes.is_empty() && p.req.prompt_tokens == 0);
        // A worker named directly is routed on its cache even under round-robin.
        let p = rr
            .prepare(&fake, "k#2", "m".into(), prompt(), None, true)
            .await
            .unwrap();
        assert!(p.tokenized);
        assert_eq!(fake.calls.lock().unwrap().len(), 1);

        let kv = state_with(PolicyKind::KvAware);
        kv.register_worker(record("a"));
        let image = (prompt().0, true);
        let p = kv
            .prepare(&fake, "k#3", "m".into(), image, None, false)
            .await
            .unwrap();
        assert!(!p.tokenized);
        assert!(
            kv.render_metrics()
                .contains("cache_locality_skipped_total{reason=\"multimodal\"} 1")
        );
        let e = kv
            .prepare(&fake, "k#4", "other".into(), prompt(), None, false)
            .await
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::NotFound);
        assert_eq!(
            fake.calls.lock().unwrap().len(),
            1,
            "nothing more tokenized"
        );
    }

    #[tokio::test]
    async fn a_refused_prompt_is_the_clients_error_and_counted() {
        let st = state_with(PolicyKind::KvAware);
        st.register_worker(record("a"));
        let fake = Fake {
            refuse: true,
            ..Fake::default()
        };
        let e = st
            .prepare(&fake, "k#1", "m".into(), prompt(), None, false)
            .await
            .unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (ErrorCode::BadRequest, "chat template: no")
        );
        assert!(st.render_metrics().contains("tokenizer_failures_total 1"));
    }
}
