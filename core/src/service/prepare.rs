//! A parsed request made ready to decide: its prompt tokenized through the [`Tokenize`] port
//! and hashed at every block size the model's workers use (and, for workers that render a chat
//! their own way, their rendering hashed at theirs).
//!
//! Round-robin ignores the prefix, so its requests are not tokenized at all. A prompt's images
//! are keyed as the engine keys them (their runs, from the tokenizer, join the request's
//! [`KvIdentity`]); a prompt with a part the tokenizer cannot key (audio, a remote image, an
//! image for a model whose expansion it does not know) is not tokenized either: a text prefix
//! match could send it to another image's KV, so it is routed by load (the Python Infera's
//! `cache_locality_skipped{reason="multimodal"}`).

use super::Service;
use super::reply::RequestError;
use crate::event::Retention;
use crate::hashing::identity::MmRun;
use crate::hashing::{KvIdentity, hash_prompt_blocks};
use crate::ids::{RequestId, SessionKey};
use crate::kv_events::kvd;
use crate::policy::{KvdHashes, RouteError, RouteRequest, WorkerHashes};
use crate::ports::tokenize::{Tokenize, TokenizeError, Tokens};

/// A request ready to decide: its [`RouteRequest`] and the prompt's token ids.
#[derive(Debug)]
pub struct Prepared {
    pub req: RouteRequest,
    pub tokens: Vec<u32>,
    /// The prompt's images among `tokens`, as the blocks were keyed by them.
    pub images: Vec<MmRun>,
    /// Whether the prompt was tokenized (round-robin needs no prefix: not tokenized at all).
    pub tokenized: bool,
}

/// What besides its prompt shapes how a request is hashed and routed.
#[derive(Debug, Clone, Default)]
pub struct RequestKeys {
    /// The client's retention hint.
    pub retention: Option<Retention>,
    /// Whether the request names its worker (direct mode): its prefix is hashed even under
    /// round-robin.
    pub direct: bool,
    /// The request's cache salt and multimodal items; the adapter is filled in from the model.
    pub identity: KvIdentity,
    /// The conversation the client named.
    pub session: Option<SessionKey>,
}

impl Service {
    /// Tokenizes and hashes `prompt` for a request keyed `key` (see [`Service::request_key`])
    /// to `model` (a base model or an adapter), unless the policy needs no prefix and no worker
    /// is `direct`ly named. The blocks are keyed by the request's identity (adapter, salt,
    /// images) as the engine keys them. See the module docs.
    ///
    /// # Errors
    /// A model no worker serves (404); a prompt the tokenizer or chat template refuses.
    pub async fn prepare<T: Tokenize + ?Sized>(
        &self,
        tokenizer: &T,
        key: &str,
        model: String,
        prompt: T::Prompt,
        request: RequestKeys,
    ) -> Result<Prepared, RequestError> {
        let RequestKeys {
            retention,
            direct,
            mut identity,
            session,
        } = request;
        let served = self.with_fleet(|f| {
            f.served(&model)
                .map(|s| {
                    (
                        s.block_sizes.clone(),
                        s.parent.clone(),
                        f.kvd_namespaces(&model),
                    )
                })
                .ok_or_else(|| RouteError::unknown_model(f, &model))
        });
        let (block_sizes, parent, kvd_namespaces) = match served {
            Ok(s) => s,
            Err(e) => {
                self.metrics().decision("unknown_model");
                return Err(RequestError::of(&e));
            }
        };
        // vLLM keys an adapter's blocks by the adapter's name: the name clients send as `model`.
        // An adapter is tokenized as its base model.
        identity.lora = parent.is_some().then(|| Box::from(model.as_str()));
        let base = parent.as_deref().unwrap_or(&model).to_owned();
        if tokenizer.unkeyed(&prompt, &base) {
            self.metrics().locality_skipped("multimodal");
            return Ok(Self::by_load(model, key, retention, session));
        }
        if !direct && !self.inner.options.router.policy.spec().needs_prefix {
            return Ok(Self::by_load(model, key, retention, session));
        }
        let renderings = tokenizer.renderings(&prompt, &model);
        let mut per_worker = WorkerHashes::default();
        for (variant, (how, workers)) in (1u32..).zip(renderings) {
            let tokens = self
                .tokenize(tokenizer, &base, prompt.clone(), Some(how))
                .await?;
            identity.mm = tokens.mm;
            let mut sizes: Vec<u32> = workers.iter().map(|(_, bs)| *bs).collect();
            sizes.sort_unstable();
            sizes.dedup();
            for bs in sizes {
                let blocks = hash_prompt_blocks(&tokens.ids, bs.max(1) as usize, &identity);
                per_worker.hashes.push((variant, bs, blocks));
            }
            per_worker
                .workers
                .extend(workers.into_iter().map(|(worker, _)| (worker, variant)));
        }
        let Tokens { ids: tokens, mm } = self.tokenize(tokenizer, &base, prompt, None).await?;
        identity.mm = mm;
        let hashes = block_sizes
            .into_iter()
            .map(|bs| {
                (
                    bs,
                    hash_prompt_blocks(&tokens, bs.max(1) as usize, &identity),
                )
            })
            .collect();
        // What the candidates' kvds hold is named by the connectors' keys, in the base model's
        // namespace (a kvd cannot see tokens; kv_events::kvd).
        let kvd = kvd_namespaces
            .into_iter()
            .map(|(bs, compat_key)| KvdHashes {
                block_size: bs,
                hashes: kvd::request_hashes(
                    &base,
                    &compat_key,
                    &tokens,
                    bs.max(1) as usize,
                    &identity,
                ),
                compat_key,
            })
            .collect();
        let req = RouteRequest {
            request_id: RequestId::new(key),
            model,
            prompt_tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            hashes,
            retention,
            per_worker,
            exclude: Vec::new(),
            session,
            kvd,
        };
        Ok(Prepared {
            req,
            tokens,
            images: identity.mm,
            tokenized: true,
        })
    }

    /// A request routed by load alone: no tokens, no hashes.
    fn by_load(
        model: String,
        key: &str,
        retention: Option<Retention>,
        session: Option<SessionKey>,
    ) -> Prepared {
        Prepared {
            req: RouteRequest {
                request_id: RequestId::new(key),
                model,
                prompt_tokens: 0,
                hashes: Vec::new(),
                retention,
                per_worker: WorkerHashes::default(),
                exclude: Vec::new(),
                session,
                kvd: Vec::new(),
            },
            tokens: Vec::new(),
            images: Vec::new(),
            tokenized: false,
        }
    }

    /// The prompt's token ids through `tokenizer` with base model `model`'s tokenizer (see
    /// [`Tokenize::tokenize`]); a failure is counted and logged.
    ///
    /// # Errors
    /// The tokenizer's, as the client's answer (400 for a prompt the template refuses).
    pub async fn tokenize<T: Tokenize + ?Sized>(
        &self,
        tokenizer: &T,
        model: &str,
        prompt: T::Prompt,
        rendering: Option<T::Rendering>,
    ) -> Result<Tokens, RequestError> {
        tokenizer
            .tokenize(model, prompt, rendering)
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
    use crate::policy::PolicyKind;
    use crate::ports::tokenize::Rendering;
    use crate::service::test_support::{record, state_with};
    use async_trait::async_trait;
    use std::sync::Mutex;

    /// A prompt is its token ids and whether it holds a part the tokenizer cannot key; a
    /// rendering puts its token in front; `mm` are the runs it reports. Every call is
    /// remembered.
    #[derive(Debug, Default)]
    struct Fake {
        calls: Mutex<Vec<Option<u32>>>,
        models: Mutex<Vec<String>>,
        other: Vec<(u32, Vec<(WorkerId, u32)>)>,
        refuse: bool,
        mm: Vec<crate::hashing::identity::MmRun>,
    }

    #[async_trait]
    impl Tokenize for Fake {
        type Prompt = (Vec<u32>, bool);
        type Rendering = u32;

        fn unkeyed(&self, prompt: &Self::Prompt, _: &str) -> bool {
            prompt.1
        }

        fn renderings(&self, _: &Self::Prompt, _: &str) -> Vec<Rendering<u32>> {
            self.other.clone()
        }

        async fn tokenize(
            &self,
            model: &str,
            prompt: Self::Prompt,
            rendering: Option<u32>,
        ) -> Result<Tokens, TokenizeError> {
            self.calls.lock().expect("calls").push(rendering);
            self.models.lock().expect("models").push(model.to_owned());
            if self.refuse {
                return Err(TokenizeError::Refused("chat template: no".into()));
            }
            Ok(Tokens {
                ids: rendering.into_iter().chain(prompt.0).collect(),
                mm: self.mm.clone(),
            })
        }
    }

    fn sized(id: &str, block_size: u32) -> WorkerRecord {
        WorkerRecord {
            kv_block_size: block_size,
            ..record(id)
        }
    }

    fn direct() -> RequestKeys {
        RequestKeys {
            direct: true,
            ..RequestKeys::default()
        }
    }

    fn prompt() -> (Vec<u32>, bool) {
        ((0..64).collect(), false)
    }

    #[tokio::test]
    async fn a_prompt_is_hashed_at_each_block_size_and_each_workers_own_rendering() {
        let st = state_with(PolicyKind::KV_AWARE);
        st.register_worker(sized("a", 16));
        st.register_worker(sized("b", 32));
        let fake = Fake {
            other: vec![(7, vec![(WorkerId::new("b"), 32)])],
            ..Fake::default()
        };
        let p = st
            .prepare(&fake, "k#1", "m".into(), prompt(), RequestKeys::default())
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
        let rr = state_with(PolicyKind::ROUND_ROBIN);
        rr.register_worker(record("a"));
        let p = rr
            .prepare(&fake, "k#1", "m".into(), prompt(), RequestKeys::default())
            .await
            .unwrap();
        assert!(!p.tokenized && p.req.hashes.is_empty() && p.req.prompt_tokens == 0);
        // A worker named directly is routed on its cache even under round-robin.
        let p = rr
            .prepare(&fake, "k#2", "m".into(), prompt(), direct())
            .await
            .unwrap();
        assert!(p.tokenized);
        assert_eq!(fake.calls.lock().unwrap().len(), 1);

        let kv = state_with(PolicyKind::KV_AWARE);
        kv.register_worker(record("a"));
        let image = (prompt().0, true);
        let p = kv
            .prepare(&fake, "k#3", "m".into(), image, RequestKeys::default())
            .await
            .unwrap();
        assert!(!p.tokenized);
        assert!(
            kv.render_metrics()
                .contains("cache_locality_skipped_total{reason=\"multimodal\"} 1")
        );
        let e = kv
            .prepare(
                &fake,
                "k#4",
                "other".into(),
                prompt(),
                RequestKeys::default(),
            )
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
    async fn an_images_run_keys_the_blocks_it_covers_and_no_earlier_one() {
        let st = state_with(PolicyKind::KV_AWARE);
        st.register_worker(sized("a", 16));
        let hashes = |mm: Vec<crate::hashing::identity::MmRun>| {
            let st = st.clone();
            async move {
                let fake = Fake {
                    mm,
                    ..Fake::default()
                };
                st.prepare(&fake, "k", "m".into(), prompt(), RequestKeys::default())
                    .await
                    .unwrap()
                    .req
                    .hashes[0]
                    .1
                    .clone()
            }
        };
        let run = |id: &str| crate::hashing::identity::MmRun {
            offset: 20,
            length: 30,
            id: id.into(),
        };
        let plain = hashes(Vec::new()).await;
        let cat = hashes(vec![run("cat")]).await;
        let dog = hashes(vec![run("dog")]).await;
        assert_eq!(cat[0], plain[0], "the block before the image is text");
        for i in 1..4 {
            assert_ne!(cat[i], plain[i]);
            assert_ne!(cat[i], dog[i], "another image is another block");
        }
        assert_eq!(cat, hashes(vec![run("cat")]).await, "the same image hits");
    }

    #[tokio::test]
    async fn an_adapter_or_a_salt_keys_the_blocks_and_an_unknown_name_lists_what_is_served() {
        let st = state_with(PolicyKind::KV_AWARE);
        let mut a = record("a");
        a.set_lora_adapters(&["sql".to_owned()]);
        st.register_worker(a);
        let fake = Fake::default();
        let base = st
            .prepare(&fake, "k#1", "m".into(), prompt(), RequestKeys::default())
            .await
            .unwrap();
        let bs = base.req.hashes[0].0 as usize;
        let plain = crate::hashing::hash_blocks(&prompt().0, bs, None);
        assert_eq!(base.req.hashes[0].1, plain);
        let adapter = st
            .prepare(&fake, "k#2", "sql".into(), prompt(), RequestKeys::default())
            .await
            .unwrap();
        let sql = KvIdentity {
            lora: Some("sql".into()),
            ..KvIdentity::default()
        };
        assert_eq!(
            adapter.req.hashes[0].1,
            hash_prompt_blocks(&prompt().0, bs, &sql)
        );
        assert_ne!(adapter.req.hashes[0].1[0], plain[0]);
        let salted = KvIdentity {
            salt: Some("tenant".into()),
            ..KvIdentity::default()
        };
        let keys = RequestKeys {
            identity: salted.clone(),
            ..RequestKeys::default()
        };
        let salt = st
            .prepare(&fake, "k#3", "m".into(), prompt(), keys)
            .await
            .unwrap();
        assert_eq!(
            salt.req.hashes[0].1,
            hash_prompt_blocks(&prompt().0, bs, &salted)
        );
        let e = st
            .prepare(
                &fake,
                "k#4",
                "nope".into(),
                prompt(),
                RequestKeys::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::NotFound);
        assert!(e.message.contains("served: m, sql"), "{}", e.message);
        let text = st.render_metrics();
        for line in [
            r#"infera_model_routable_ranks{model="m",parent=""} 1"#,
            r#"infera_model_routable_ranks{model="sql",parent="m"} 1"#,
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }

    #[tokio::test]
    async fn a_refused_prompt_is_the_clients_error_and_counted() {
        let st = state_with(PolicyKind::KV_AWARE);
        st.register_worker(record("a"));
        let fake = Fake {
            refuse: true,
            ..Fake::default()
        };
        let e = st
            .prepare(&fake, "k#1", "m".into(), prompt(), RequestKeys::default())
            .await
            .unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (ErrorCode::BadRequest, "chat template: no")
        );
        assert!(st.render_metrics().contains("tokenizer_failures_total 1"));
    }
}
