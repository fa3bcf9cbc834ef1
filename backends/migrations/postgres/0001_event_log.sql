-- The event log (contract: backends/src/log/sql/mod.rs).

-- One envelope per row; `envelope` is the golden JSON as jsonb (fixtures/events/v1.jsonl).
CREATE TABLE events (
    seq        BIGINT PRIMARY KEY,
    ts_us      BIGINT  NOT NULL,
    kind       TEXT    NOT NULL,
    worker     TEXT,
    dp_rank    BIGINT,
    model      TEXT,
    request_id TEXT,
    envelope   JSONB   NOT NULL
);
CREATE INDEX events_kind_ts ON events (kind, ts_us);
CREATE INDEX events_worker_ts ON events (worker, ts_us) WHERE worker IS NOT NULL;
CREATE INDEX events_request ON events (request_id) WHERE request_id IS NOT NULL;

-- The log's own counters: one row.
CREATE TABLE log_state (
    id             SMALLINT PRIMARY KEY CHECK (id = 1),
    last_seq       BIGINT  NOT NULL,
    compacted_upto BIGINT  NOT NULL
);
INSERT INTO log_state (id, last_seq, compacted_upto) VALUES (1, 0, 0);

-- The latest projection dump: {"v":1,"upto":N,"events":[...]}.
CREATE TABLE snapshots (
    upto       BIGINT PRIMARY KEY,
    created_us BIGINT  NOT NULL,
    snapshot   TEXT    NOT NULL
);

-- One routed request, completed when it finishes; kept by compaction.
CREATE TABLE requests (
    request_id     TEXT    PRIMARY KEY,
    model          TEXT    NOT NULL,
    worker         TEXT    NOT NULL,
    dp_rank        BIGINT  NOT NULL,
    role           TEXT    NOT NULL,
    hour           TEXT    NOT NULL,
    routed_seq     BIGINT  NOT NULL,
    routed_us      BIGINT  NOT NULL,
    policy         TEXT    NOT NULL,
    prompt_tokens  BIGINT  NOT NULL,
    request_blocks BIGINT  NOT NULL,
    overlap_blocks BIGINT  NOT NULL,
    finished_seq   BIGINT,
    finished_us    BIGINT,
    status         TEXT,
    ttft_us        BIGINT,
    tokens_in      BIGINT,
    tokens_out     BIGINT,
    cached_tokens  BIGINT
);
CREATE INDEX requests_model_worker_hour ON requests (model, worker, hour);
