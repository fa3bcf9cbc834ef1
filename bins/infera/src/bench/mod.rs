//! `infera bench`: plays a trace against a live OpenAI-compatible endpoint on the trace's own
//! timeline and reports what users measure.
//!
//! # Load model
//! Open loop: request `i` is sent at `(arrival_i - arrival_0) / --speedup` after the start,
//! whether or not earlier requests have finished. `--max-concurrency` bounds the requests in
//! flight; a request that finds no free slot waits for one (slots are handed out in arrival
//! order), and its wait is recorded and counted, so a saturated target shows up as send lag
//! rather than as a silently slower schedule.
//!
//! Sessions (`--playback sessions`, the default): a row with a `session_id` and a
//! `think_time_us` (what `infera trace synth` writes) is a turn whose client waited for the
//! previous turn of its session; it is sent `think_time_us / --speedup` after its predecessor's
//! answer ended (its last chunk, or its error), not at its recorded arrival, and its scheduled
//! time is that moment. Every other row keeps the timeline. `--limit` and `--duration` apply to
//! session turns as to the rest.
//!
//! Everything runs on one thread (a current-thread tokio runtime): the dispatcher sleeps until
//! each scheduled time and spawns the request; each request task builds its body (prompt from
//! the trace's block hashes, see [`infera_replay::bench`]), sends it with `stream: true` and
//! `stream_options.include_usage`, and timestamps every SSE chunk that carries text (TTFT is
//! send → first text chunk; inter-token latency the gaps between text chunks). The summary's
//! send lag (scheduled → sent) shows whether the generator kept up with its own schedule.
//!
//! # Outcome
//! Exit 0 when at least one request succeeded (errors are counted and reported); exit 1 when
//! none did (the first error is named); exit 2 for invalid flags.

use crate::cli::bench::{Api, BenchArgs};
use crate::cli::replay::PlaybackArg;
use crate::replay_cmd::{ReplayFailure, check_output_path};
use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::Request;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use infera_replay::bench::{
    BenchSummary, Chunk, RequestRecord, SseParser, Status, parse_chunk, prompt_text, prompt_tokens,
    to_sim_result,
};
use infera_replay::output;
use infera_replay::report::Summary;
use infera_replay::sim::{Playback, SessionLinks};
use infera_replay::trace::{self, TraceRequest};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// The checked flags.
#[derive(Debug, Clone)]
struct Settings {
    /// `http://host:port` plus the endpoint path.
    uri: hyper::Uri,
    timeout: Duration,
}

/// Checks the flags that need no trace and resolves the endpoint.
fn validate(args: &BenchArgs) -> anyhow::Result<Settings> {
    if !(args.speedup.is_finite() && args.speedup > 0.0) {
        bail!("--speedup must be above 0 (got {})", args.speedup);
    }
    if args.max_concurrency == Some(0) {
        bail!("--max-concurrency must be at least 1");
    }
    if args.limit == Some(0) {
        bail!("--limit must be at least 1");
    }
    if args.max_tokens == Some(0) {
        bail!("--max-tokens must be at least 1");
    }
    if let Some(d) = args.duration
        && !(d.is_finite() && d > 0.0)
    {
        bail!("--duration must be a positive number of seconds (got {d})");
    }
    if !(args.timeout.is_finite() && args.timeout > 0.0) {
        bail!(
            "--timeout must be a positive number of seconds (got {})",
            args.timeout
        );
    }
    check_output_path(args.out.as_deref(), "parquet", "--out")?;
    let base = args.target.trim_end_matches('/');
    let base = base.strip_suffix("/v1").unwrap_or(base);
    if !base.starts_with("http://") {
        bail!(
            "--target {}: expected an http:// URL such as http://127.0.0.1:8000 (https is not \
             supported)",
            args.target
        );
    }
    let path = match args.api {
        Api::Completions => "/v1/completions",
        Api::Chat => "/v1/chat/completions",
    };
    let uri: hyper::Uri = format!("{base}{path}")
        .parse()
        .with_context(|| format!("--target {}: not a valid URL", args.target))?;
    if uri.host().is_none() {
        bail!("--target {}: the URL has no host", args.target);
    }
    Ok(Settings {
        uri,
        timeout: Duration::from_secs_f64(args.timeout),
    })
}

/// Runs `infera bench`.
///
/// # Errors
/// [`ReplayFailure::Invalid`] for invalid flags (nothing was sent), [`ReplayFailure::Failed`]
/// for a trace that cannot be read, a file that cannot be written, or a run in which no request
/// succeeded.
pub fn run(args: BenchArgs) -> Result<(), ReplayFailure> {
    let settings = validate(&args).map_err(ReplayFailure::Invalid)?;
    Ok(bench(&args, settings)?)
}

/// One request to send: where it sits in the trace and when it is due.
#[derive(Debug)]
struct Planned {
    index: usize,
    scheduled_us: u64,
}

/// How sessions are played and where the run stops.
#[derive(Debug)]
struct Play {
    links: SessionLinks,
    speedup: f64,
    /// Requests at or past this index are not sent.
    limit: usize,
    /// Requests due at or after this offset from the start are not sent.
    until_us: Option<f64>,
}

impl Play {
    fn new(requests: &[TraceRequest], args: &BenchArgs) -> Self {
        let playback = match args.playback {
            PlaybackArg::Sessions => Playback::Sessions,
            PlaybackArg::Timeline => Playback::Timeline,
        };
        Self {
            links: SessionLinks::new(requests, playback),
            speedup: args.speedup,
            limit: args.limit.unwrap_or(usize::MAX),
            until_us: args.duration.map(|d| d * 1e6),
        }
    }

    /// The session turn that request `i`'s answer releases, and its think time.
    fn next(&self, trace: &[TraceRequest], i: usize) -> Option<(usize, Duration)> {
        let j = self.links.next(i).filter(|&j| j < self.limit)?;
        let think_us = trace[j].think_time_us.unwrap_or(0) as f64 / self.speedup;
        Some((j, Duration::from_micros(think_us as u64)))
    }
}

/// The timeline's requests, in order, with their due times (see the module docs); session
/// turns that wait for a predecessor are sent by [`session`] instead.
fn plan(requests: &[TraceRequest], play: &Play) -> Vec<Planned> {
    let first = requests.first().map_or(0, |r| r.arrival_us);
    let limit_us = play.until_us;
    let speedup = play.speedup;
    requests
        .iter()
        .enumerate()
        .take(play.limit)
        .filter(|(index, _)| !play.links.follows(*index))
        .map(|(index, r)| Planned {
            index,
            scheduled_us: ((r.arrival_us - first) as f64 / speedup) as u64,
        })
        .take_while(|p| limit_us.is_none_or(|l| (p.scheduled_us as f64) < l))
        .collect()
}

fn bench(args: &BenchArgs, settings: Settings) -> anyhow::Result<()> {
    let opts = trace::LoadOptions {
        seed: args.seed,
        spread_buckets: !args.no_spread,
        block_size: args.trace_block_size,
        ..Default::default()
    };
    let tr = trace::load(&args.trace, &opts)?;
    let play = Play::new(&tr.requests, args);
    let planned = plan(&tr.requests, &play);
    let span_s = planned.last().map_or(0, |p| p.scheduled_us) as f64 / 1e6;
    let turns = (0..tr.requests.len().min(play.limit))
        .filter(|&i| play.links.follows(i))
        .count();
    if !args.json {
        let sessions = if turns > 0 {
            format!(" (+ up to {turns} session turns after their predecessors)")
        } else {
            String::new()
        };
        println!(
            "trace: {} — sending {}{sessions} of {} requests over {:.1} s (speedup {}) to {}",
            args.trace.display(),
            planned.len(),
            tr.requests.len(),
            span_s,
            args.speedup,
            settings.uri
        );
        for n in &tr.notes {
            println!("note: {n}");
        }
    }
    let trace = Arc::new(tr.requests);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    let mut records = runtime.block_on(drive(
        args,
        &settings,
        Arc::clone(&trace),
        Arc::new(play),
        planned,
    ));
    records.sort_by_key(|r| r.index);
    let summary = BenchSummary::of(&records);
    if summary.ok == 0 {
        let why = records
            .iter()
            .map(|r| describe(&r.status))
            .next()
            .unwrap_or_else(|| "no request was scheduled".to_owned());
        bail!("no request succeeded (first: {why})");
    }
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        print!("{}", summary.render());
    }
    if let Some(out) = &args.out {
        let sim = to_sim_result(&records);
        let ideal = trace::summarize(&trace::Trace {
            requests: records.iter().map(|r| trace[r.index].clone()).collect(),
            source: String::new(),
            notes: Vec::new(),
        })
        .ideal_hit_rate;
        let params = json!({
            "target": args.target,
            "api": format!("{:?}", args.api).to_lowercase(),
            "speedup": args.speedup,
            "max_concurrency": args.max_concurrency,
            "max_tokens": args.max_tokens,
            "bench": serde_json::to_value(&summary)?,
        });
        output::write_measured(
            out,
            "live",
            &params.to_string(),
            &sim,
            &Summary::of(&sim, ideal),
        )?;
        if !args.json {
            println!(
                "wrote {} and {}",
                out.display(),
                output::summary_path(out).display()
            );
        }
    }
    Ok(())
}

fn describe(status: &Status) -> String {
    match status {
        Status::Ok => "ok".to_owned(),
        Status::Http(code) => format!("HTTP {code}"),
        Status::Stream(m) => format!("stream error: {m}"),
        Status::Transport(m) => m.clone(),
    }
}

/// Sends every planned request on its schedule and collects the records.
async fn drive(
    args: &BenchArgs,
    settings: &Settings,
    trace: Arc<Vec<TraceRequest>>,
    play: Arc<Play>,
    planned: Vec<Planned>,
) -> Vec<RequestRecord> {
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(infera_adapters::server::transport::nodelay_connector());
    let slots = args.max_concurrency.map(|n| Arc::new(Semaphore::new(n)));
    let shape = Arc::new(Shape {
        api: args.api,
        model: args.model.clone(),
        max_tokens: args.max_tokens,
        ignore_eos: !args.no_ignore_eos,
        uri: settings.uri.clone(),
        timeout: settings.timeout,
    });
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    let mut records = Vec::with_capacity(planned.len());
    for p in planned {
        let due = start + Duration::from_micros(p.scheduled_us);
        // Collect what finished while waiting, so that memory follows the requests in flight.
        loop {
            tokio::select! {
                biased;
                () = tokio::time::sleep_until(due) => break,
                Some(done) = tasks.join_next() => push_joined(&mut records, done),
            }
        }
        let (client, trace, shape, slots, play) = (
            client.clone(),
            Arc::clone(&trace),
            Arc::clone(&shape),
            slots.clone(),
            Arc::clone(&play),
        );
        tasks.spawn(async move {
            let ctx = Ctx {
                client: &client,
                trace: &trace,
                shape: &shape,
                slots: slots.as_deref(),
                start,
            };
            session(&ctx, &play, p).await
        });
    }
    while let Some(done) = tasks.join_next().await {
        push_joined(&mut records, done);
    }
    records
}

/// What one request task needs to send requests.
struct Ctx<'a> {
    client: &'a HttpClient,
    trace: &'a [TraceRequest],
    shape: &'a Shape,
    slots: Option<&'a Semaphore>,
    start: Instant,
}

/// Sends a timeline request, then each session turn that waits for it, one think time after the
/// previous answer ended, until the session ends or `--limit` / `--duration` stop it.
async fn session(ctx: &Ctx<'_>, play: &Play, first: Planned) -> Vec<RequestRecord> {
    let mut records = Vec::new();
    let mut p = first;
    loop {
        let i = p.index;
        records.push(one(ctx.client, ctx.trace, ctx.shape, ctx.slots, ctx.start, p).await);
        let Some((j, think)) = play.next(ctx.trace, i) else {
            break;
        };
        let due = Instant::now() + think;
        let scheduled_us = micros(due - ctx.start);
        if play.until_us.is_some_and(|l| scheduled_us as f64 >= l) {
            break;
        }
        tokio::time::sleep_until(due).await;
        p = Planned {
            index: j,
            scheduled_us,
        };
    }
    records
}

fn push_joined(
    records: &mut Vec<RequestRecord>,
    done: Result<Vec<RequestRecord>, tokio::task::JoinError>,
) {
    match done {
        Ok(r) => records.extend(r),
        // A request task cannot panic short of a bug; say so rather than lose it silently.
        Err(e) => tracing::error!(error = %e, "a request task failed"),
    }
}

/// What every request of a run shares.
#[derive(Debug)]
struct Shape {
    api: Api,
    model: Option<String>,
    max_tokens: Option<u32>,
    ignore_eos: bool,
    uri: hyper::Uri,
    timeout: Duration,
}

/// The JSON body of request `index`: an adapter's request names its adapter (`lora`) as its
/// model, unless `--model` overrides it, and carries the trace's `cache_salt`.
fn body(shape: &Shape, req: &TraceRequest, index: usize) -> Bytes {
    let model = shape
        .model
        .as_deref()
        .or(req.lora.as_deref())
        .unwrap_or(&req.model);
    let max_tokens = shape.max_tokens.unwrap_or(req.output_length).max(1);
    let mut value = match shape.api {
        Api::Completions => json!({
            "model": model,
            "prompt": prompt_tokens(req, index),
            "max_tokens": max_tokens,
        }),
        Api::Chat => json!({
            "model": model,
            "messages": [{"role": "user", "content": prompt_text(req, index)}],
            "max_tokens": max_tokens,
        }),
    };
    if let Some(map) = value.as_object_mut() {
        map.insert("stream".into(), true.into());
        map.insert("stream_options".into(), json!({"include_usage": true}));
        if shape.ignore_eos {
            map.insert("ignore_eos".into(), true.into());
        }
        if let Some(salt) = &req.cache_salt {
            map.insert("cache_salt".into(), salt.as_str().into());
        }
    }
    Bytes::from(value.to_string())
}

/// Sends one request and measures it.
async fn one(
    client: &HttpClient,
    trace: &[TraceRequest],
    shape: &Shape,
    slots: Option<&Semaphore>,
    start: Instant,
    p: Planned,
) -> RequestRecord {
    let req = &trace[p.index];
    let payload = body(shape, req, p.index);
    let ready = Instant::now();
    // A free slot is taken at once (no wait recorded); otherwise the request queues for one. The
    // semaphore is never closed, so `acquire` cannot fail (the request would then simply go).
    let (_slot, waited) = match slots.map(|s| (s, s.try_acquire())) {
        None => (None, false),
        Some((_, Ok(slot))) => (Some(slot), false),
        Some((s, Err(_))) => (s.acquire().await.ok(), true),
    };
    let sent = Instant::now();
    let mut record = RequestRecord {
        index: p.index,
        request_id: req.request_id.clone(),
        scheduled_us: p.scheduled_us,
        sent_us: micros(sent - start),
        wait_us: if waited {
            micros(sent - ready).max(1)
        } else {
            0
        },
        status: Status::Ok,
        ttft_us: None,
        itl_us: Vec::new(),
        e2e_us: 0,
        input_length: req.input_length,
        blocks: req.block_hashes.len() as u32,
        block_size: req.block_size,
        usage: None,
        text_chunks: 0,
    };
    let exchange = exchange(client, shape, payload, sent, &mut record);
    record.status = match tokio::time::timeout(shape.timeout, exchange).await {
        Ok(status) => status,
        Err(_) => Status::Transport(format!(
            "no complete answer within --timeout {} s",
            shape.timeout.as_secs_f64()
        )),
    };
    record.e2e_us = micros(sent.elapsed());
    record
}

/// The HTTP exchange of one request: fills in the timings and usage, returns how it ended.
async fn exchange(
    client: &HttpClient,
    shape: &Shape,
    payload: Bytes,
    sent: Instant,
    record: &mut RequestRecord,
) -> Status {
    let request = match Request::post(shape.uri.clone())
        .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
        .body(Full::new(payload))
    {
        Ok(r) => r,
        Err(e) => return Status::Transport(format!("cannot build the request: {e}")),
    };
    let response = match client.request(request).await {
        Ok(r) => r,
        Err(e) => return Status::Transport(format!("{}: {e:#}", shape.uri)),
    };
    let status = response.status();
    let mut body = response.into_body();
    if !status.is_success() {
        // Read the error body so the connection can be reused; its content is not needed.
        while let Some(Ok(_)) = body.frame().await {}
        return Status::Http(status.as_u16());
    }
    let mut parser = SseParser::default();
    let mut last_text: Option<Instant> = None;
    let mut ended: Option<Status> = None;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            Err(e) => return Status::Stream(format!("the stream broke: {e}")),
        };
        let Some(data) = frame.data_ref() else {
            continue;
        };
        let now = Instant::now();
        parser.feed(data, |payload| match parse_chunk(payload) {
            Chunk::Done => {
                if ended.is_none() {
                    ended = Some(Status::Ok);
                }
            }
            Chunk::Error(m) => ended = Some(Status::Stream(m)),
            Chunk::Invalid => {}
            Chunk::Data { text, usage } => {
                if text {
                    record.text_chunks += 1;
                    match last_text {
                        None => record.ttft_us = Some(micros(now - sent)),
                        Some(prev) => record
                            .itl_us
                            .push(u32::try_from(micros(now - prev)).unwrap_or(u32::MAX)),
                    }
                    last_text = Some(now);
                }
                if let Some(u) = usage {
                    record.usage = Some(u);
                }
            }
        });
    }
    ended.unwrap_or_else(|| Status::Stream("the stream ended without [DONE]".to_owned()))
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests;
