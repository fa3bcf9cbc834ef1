//! Per-tenant limits: requests, prompt tokens and generated tokens per minute, and concurrent
//! requests.
//!
//! # Buckets
//! Each per-minute limit `L` is a token bucket that holds one minute's allowance and refills
//! continuously at `L` per minute, as the OpenAI API's limits behave: a tenant may spend its
//! minute at once, then gets it back smoothly. Over any interval of `t` seconds a bucket lets
//! through at most `L + L·t/60`. The bucket is kept as its theoretical arrival time (GCRA) in
//! units of microseconds × `L`, so refill is exact integer arithmetic: after spending the whole
//! allowance, exactly one unit is back `60/L` seconds later.
//!
//! Prompt tokens are taken before the request is sent. Generated tokens are only known at the
//! end: they are charged then, and may put the bucket into debt (at most one more minute's
//! allowance); a tenant in debt is refused until it has paid it back.
//!
//! # Admission
//! [`Usage::admit`] checks every limit and takes from all of them, or from none: a refusal
//! names the limit and when the request would pass ([`Refusal`]). The returned [`Permit`]
//! holds a concurrency slot until it is dropped; [`Permit::generated`] charges the answer's
//! tokens. A tenant's [`Usage`] is kept across key-file reloads ([`Usage::retune`]).
//!
//! # Replicas
//! Server replicas that share a durable event log charge each other's requests to their own
//! buckets ([`Usage::charge_peer`]), so the limits hold for the fleet, not per replica. A
//! replica cut off from its peers admits with every cost multiplied by the number of replicas
//! (the `share` of [`Usage::admit`]): it keeps to its own share of each limit alone.
//! Concurrency is counted per replica.

use crate::clock::Micros;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

const MINUTE_US: u128 = 60_000_000;

/// What a tenant may use; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    pub requests_per_minute: Option<u64>,
    pub prompt_tokens_per_minute: Option<u64>,
    pub generated_tokens_per_minute: Option<u64>,
    pub concurrent_requests: Option<u32>,
}

impl Limits {
    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        *self != Limits::default()
    }
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Requests,
    PromptTokens,
    GeneratedTokens,
    Concurrency,
}

impl Limit {
    pub const ALL: [Limit; 4] = [
        Limit::Requests,
        Limit::PromptTokens,
        Limit::GeneratedTokens,
        Limit::Concurrency,
    ];

    /// The metric label and the error's wording.
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::Requests => "requests",
            Limit::PromptTokens => "prompt_tokens",
            Limit::GeneratedTokens => "generated_tokens",
            Limit::Concurrency => "concurrency",
        }
    }
}

/// A refused request: the limit, and how long until the same request would pass (`None`:
/// never, its prompt is larger than a minute's allowance).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub limit: Limit,
    pub retry_after_us: Option<Micros>,
}

/// One per-minute bucket (see the module docs). `per_minute == 0` is unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Bucket {
    per_minute: u64,
    /// Theoretical arrival time, in µs × `per_minute`.
    tat: u128,
}

impl Bucket {
    fn new(per_minute: Option<u64>) -> Self {
        Bucket {
            per_minute: per_minute.unwrap_or(0),
            tat: 0,
        }
    }

    fn unlimited(&self) -> bool {
        self.per_minute == 0
    }

    fn scaled(&self, now: Micros) -> u128 {
        u128::from(now) * u128::from(self.per_minute)
    }

    /// How much of the minute's allowance is spent, in µs × `per_minute` (past the allowance
    /// when in debt).
    fn spent(&self, now: Micros) -> u128 {
        self.tat.saturating_sub(self.scaled(now))
    }

    fn capacity(&self) -> u128 {
        MINUTE_US * u128::from(self.per_minute)
    }

    /// `Ok` when `n` units fit now; else how long until they do (`None`: never).
    fn check(&self, now: Micros, n: u64) -> Result<(), Option<Micros>> {
        if self.unlimited() || n == 0 {
            return Ok(());
        }
        if n > self.per_minute {
            return Err(None);
        }
        let need = self.spent(now) + u128::from(n) * MINUTE_US;
        if need <= self.capacity() {
            return Ok(());
        }
        let wait = (need - self.capacity()).div_ceil(u128::from(self.per_minute));
        Err(Some(Micros::try_from(wait).unwrap_or(Micros::MAX)))
    }

    /// Takes `n` units, into debt if need be (at most one more minute's allowance).
    fn take(&mut self, now: Micros, n: u64) {
        if self.unlimited() {
            return;
        }
        let base = self.tat.max(self.scaled(now));
        let most = self.scaled(now) + 2 * self.capacity();
        self.tat = (base + u128::from(n) * MINUTE_US).min(most);
    }

    /// Units left now (0 in debt).
    fn remaining(&self, now: Micros) -> u64 {
        let left = self.capacity().saturating_sub(self.spent(now)) / MINUTE_US;
        u64::try_from(left).unwrap_or(u64::MAX)
    }

    /// µs until the bucket is full again.
    fn reset_us(&self, now: Micros) -> Micros {
        if self.unlimited() {
            return 0;
        }
        let wait = self.spent(now).div_ceil(u128::from(self.per_minute));
        Micros::try_from(wait).unwrap_or(Micros::MAX)
    }

    /// The same bucket with a new limit, as full (as a fraction) as it was.
    fn retuned(&self, now: Micros, per_minute: Option<u64>) -> Self {
        let mut next = Bucket::new(per_minute);
        if !self.unlimited() && !next.unlimited() {
            // The time to refill carries over: spent / old rate == spent' / new rate.
            let refill_us = self.spent(now) / u128::from(self.per_minute);
            next.tat = next.scaled(now) + refill_us * u128::from(next.per_minute);
        }
        next
    }
}

#[derive(Debug)]
struct Buckets {
    requests: Bucket,
    prompt: Bucket,
    generated: Bucket,
}

/// A tenant's use of its limits. See the module docs.
#[derive(Debug)]
pub struct Usage {
    buckets: Mutex<Buckets>,
    concurrent: AtomicU32,
    /// 0: unlimited.
    max_concurrent: AtomicU32,
}

/// What the `x-ratelimit-*` headers say: the request and prompt-token buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Standing {
    /// `(limit, remaining, µs until full)` of requests per minute, when limited.
    pub requests: Option<(u64, u64, Micros)>,
    /// The same of prompt tokens per minute, when limited.
    pub tokens: Option<(u64, u64, Micros)>,
}

impl Usage {
    pub fn new(limits: &Limits) -> Arc<Self> {
        Arc::new(Usage {
            buckets: Mutex::new(Buckets {
                requests: Bucket::new(limits.requests_per_minute),
                prompt: Bucket::new(limits.prompt_tokens_per_minute),
                generated: Bucket::new(limits.generated_tokens_per_minute),
            }),
            concurrent: AtomicU32::new(0),
            max_concurrent: AtomicU32::new(limits.concurrent_requests.unwrap_or(0)),
        })
    }

    fn buckets(&self) -> std::sync::MutexGuard<'_, Buckets> {
        self.buckets.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Applies new limits, keeping how much of each allowance is spent.
    pub fn retune(&self, limits: &Limits, now: Micros) {
        let mut b = self.buckets();
        b.requests = b.requests.retuned(now, limits.requests_per_minute);
        b.prompt = b.prompt.retuned(now, limits.prompt_tokens_per_minute);
        b.generated = b.generated.retuned(now, limits.generated_tokens_per_minute);
        self.max_concurrent
            .store(limits.concurrent_requests.unwrap_or(0), Ordering::Relaxed);
    }

    /// Admits one request of `prompt_tokens`, or refuses it without taking anything.
    ///
    /// # Errors
    /// The first limit that refuses, in the order concurrency, requests, prompt tokens,
    /// generated tokens (in debt).
    pub fn admit(
        self: &Arc<Self>,
        now: Micros,
        prompt_tokens: u64,
        share: u32,
    ) -> Result<Permit, Refusal> {
        let share = u64::from(share.max(1));
        let max = self.max_concurrent.load(Ordering::Relaxed);
        let slot = self
            .concurrent
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (max == 0 || n < max).then_some(n + 1)
            });
        if slot.is_err() {
            // A slot frees when a request ends: no time can be promised, one second is a hint.
            return Err(Refusal {
                limit: Limit::Concurrency,
                retry_after_us: Some(1_000_000),
            });
        }
        let permit = Permit {
            usage: Arc::clone(self),
        };
        let mut b = self.buckets();
        let refuse = |limit, wait| Refusal {
            limit,
            retry_after_us: wait,
        };
        let prompt = prompt_tokens.saturating_mul(share);
        b.requests
            .check(now, share)
            .map_err(|w| refuse(Limit::Requests, w))?;
        b.prompt
            .check(now, prompt)
            .map_err(|w| refuse(Limit::PromptTokens, w))?;
        b.generated
            .check(now, share)
            .map_err(|w| refuse(Limit::GeneratedTokens, w))?;
        b.requests.take(now, share);
        b.prompt.take(now, prompt);
        Ok(permit)
    }

    /// Charges what a peer replica admitted for this tenant: `requests`, their prompt tokens
    /// and the tokens they generated (into debt if need be).
    pub fn charge_peer(&self, now: Micros, requests: u64, prompt: u64, generated: u64) {
        let mut b = self.buckets();
        b.requests.take(now, requests);
        b.prompt.take(now, prompt);
        b.generated.take(now, generated);
    }

    /// Where the tenant stands, for the response headers.
    pub fn standing(&self, now: Micros) -> Standing {
        let b = self.buckets();
        let of = |bucket: &Bucket| {
            (!bucket.unlimited()).then(|| {
                (
                    bucket.per_minute,
                    bucket.remaining(now),
                    bucket.reset_us(now),
                )
            })
        };
        Standing {
            requests: of(&b.requests),
            tokens: of(&b.prompt),
        }
    }

    /// Requests of the tenant in flight.
    pub fn in_flight(&self) -> u32 {
        self.concurrent.load(Ordering::Relaxed)
    }
}

/// An admitted request's hold on its tenant's concurrency; see [`Usage::admit`].
#[derive(Debug)]
pub struct Permit {
    usage: Arc<Usage>,
}

impl Permit {
    /// Charges the tokens the answer generated.
    pub fn generated(&self, now: Micros, tokens: u64) {
        self.usage.buckets().generated.take(now, tokens);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.usage.concurrent.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SEC: Micros = 1_000_000;

    fn limits(rpm: u64) -> Limits {
        Limits {
            requests_per_minute: Some(rpm),
            ..Limits::default()
        }
    }

    #[test]
    fn a_spent_minute_refills_one_request_every_sixtieth_exactly() {
        let usage = Usage::new(&limits(60));
        let t0 = 1_000 * SEC;
        let held: Vec<_> = (0..60).map(|_| usage.admit(t0, 0, 1).unwrap()).collect();
        drop(held);
        let refused = usage.admit(t0, 0, 1).unwrap_err();
        assert_eq!(refused.limit, Limit::Requests);
        assert_eq!(refused.retry_after_us, Some(SEC));
        assert!(usage.admit(t0 + SEC - 1, 0, 1).is_err());
        assert!(usage.admit(t0 + SEC, 0, 1).is_ok());
        assert!(usage.admit(t0 + SEC, 0, 1).is_err());
    }

    #[test]
    fn a_refusal_takes_nothing_from_the_other_limits() {
        let usage = Usage::new(&Limits {
            requests_per_minute: Some(10),
            prompt_tokens_per_minute: Some(1_000),
            ..Limits::default()
        });
        let now = 50 * SEC;
        let refused = usage.admit(now, 1_500, 1).unwrap_err();
        assert_eq!(refused.limit, Limit::PromptTokens);
        assert_eq!(
            refused.retry_after_us, None,
            "larger than a minute's allowance"
        );
        assert!(usage.admit(now, 800, 1).is_ok());
        let refused = usage.admit(now, 300, 1).unwrap_err();
        assert_eq!(refused.limit, Limit::PromptTokens);
        // 100 tokens short at 1,000 a minute: six seconds.
        assert_eq!(refused.retry_after_us, Some(6 * SEC));
        let standing = usage.standing(now);
        assert_eq!(
            standing.requests.map(|r| r.1),
            Some(9),
            "only one request taken"
        );
        assert_eq!(standing.tokens.map(|t| t.1), Some(200));
    }

    #[test]
    fn generated_tokens_put_a_tenant_in_debt_until_paid_back() {
        let usage = Usage::new(&Limits {
            generated_tokens_per_minute: Some(600),
            ..Limits::default()
        });
        let now = 10 * SEC;
        let permit = usage.admit(now, 0, 1).unwrap();
        permit.generated(now, 900);
        drop(permit);
        let refused = usage.admit(now, 0, 1).unwrap_err();
        assert_eq!(refused.limit, Limit::GeneratedTokens);
        // 300 in debt plus the one unit a request needs, at 10 a second.
        assert_eq!(refused.retry_after_us, Some(30_100_000));
        assert!(usage.admit(now + 30_100_000, 0, 1).is_ok());
    }

    #[test]
    fn concurrency_is_held_until_the_permit_drops() {
        let usage = Usage::new(&Limits {
            concurrent_requests: Some(2),
            ..Limits::default()
        });
        let a = usage.admit(0, 0, 1).unwrap();
        let _b = usage.admit(0, 0, 1).unwrap();
        assert_eq!(usage.admit(0, 0, 1).unwrap_err().limit, Limit::Concurrency);
        assert_eq!(usage.in_flight(), 2);
        drop(a);
        assert!(usage.admit(0, 0, 1).is_ok());
    }

    #[test]
    fn peers_charge_their_requests_and_a_cut_off_replica_keeps_to_its_share() {
        let usage = Usage::new(&limits(60));
        usage.charge_peer(0, 40, 0, 0);
        assert_eq!(
            (0..100).filter(|_| usage.admit(0, 0, 1).is_ok()).count(),
            20
        );
        let alone = Usage::new(&limits(60));
        assert_eq!(
            (0..100).filter(|_| alone.admit(0, 0, 2).is_ok()).count(),
            30,
            "one of two replicas, cut off: half the minute"
        );
    }

    #[test]
    fn a_retune_keeps_the_share_spent() {
        let usage = Usage::new(&limits(100));
        for _ in 0..50 {
            usage.admit(0, 0, 1).unwrap();
        }
        usage.retune(&limits(200), 0);
        assert_eq!(usage.standing(0).requests, Some((200, 100, 30 * SEC)));
        usage.retune(&Limits::default(), 0);
        assert_eq!(usage.standing(0), Standing::default());
        assert!((0..1_000).all(|_| usage.admit(0, 0, 1).is_ok()));
    }

    proptest! {
        /// Over any interval, a bucket of `L` a minute lets through at most `L + L·t/60`; a
        /// refusal's wait is exact: the request passes after it and not one microsecond sooner.
        #[test]
        fn a_bucket_never_passes_more_than_its_allowance(
            per_minute in 1u64..5_000,
            arrivals in proptest::collection::vec((0u64..5_000_000, 1u64..300), 1..200),
        ) {
            let mut bucket = Bucket::new(Some(per_minute));
            let mut now = 0;
            let mut passed: Vec<(Micros, u64)> = Vec::new();
            for (gap, n) in arrivals {
                now += gap;
                match bucket.check(now, n) {
                    Ok(()) => {
                        bucket.take(now, n);
                        passed.push((now, n));
                    }
                    Err(Some(wait)) => {
                        prop_assert!(bucket.check(now + wait, n).is_ok());
                        prop_assert!(bucket.check(now + wait - 1, n).is_err());
                    }
                    Err(None) => prop_assert!(n > per_minute),
                }
            }
            for (i, (start, _)) in passed.iter().enumerate() {
                let mut sum = 0u128;
                for (t, n) in &passed[i..] {
                    sum += u128::from(*n);
                    let span = u128::from(t - start);
                    let bound = u128::from(per_minute) * (MINUTE_US + span);
                    prop_assert!(sum * MINUTE_US <= bound, "{sum} tokens in {span} µs at {per_minute}/min");
                }
            }
        }
    }
}
