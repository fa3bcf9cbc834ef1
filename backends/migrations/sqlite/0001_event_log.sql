-- The event log (contract: backends/src/log/sql/mod.rs).

-- One envelope per row; `envelope` is the golden JSON (fixtures/events/v1.jsonl).
CREATE TABLE events (
    seq        INTEGER PRIMARY KEY,
    ts_us      INTEGER NOT NULL,
    kind       TEXT    NOT NULL,
    worker     TEXT,
    dp_rank    INTEGER,
    model      TEXT,
    request_id TEXT,
    envelope   TEXT    NOT NULL
);
CREATE INDEX events_kind_ts ON events (kind, ts_us);
CREATE INDEX events_worker_ts ON events (worker, ts_us) WHERE worker IS NOT NULL;
CREATE INDEX events_request ON events (request_id) WHERE request_id IS NOT NULL;

-- The log's own counters: one row.
CREATE TABLE log_state (
    id             INTEGER PRIMARY KEY CHECK (id = 1),
    last_seq       INTEGER NOT NULL,
    compacted_upto INTEGER NOT NULL
);
INSERT INTO log_state (id, last_seq, compacted_upto) VALUES (1, 0, 0);

-- The latest projection dump: {"v":1,"upto":N,"events":[...]}.
CREATE TABLE snapshots (
    upto       INTEGER PRIMARY KEY,
    created_us INTEGER NOT NULL,
    snapshot   TEXT    NOT NULL
);

-- One routed request, completed when it finishes; kept by compaction.
CREATE TABLE requests (
    request_id     TEXT    PRIMARY KEY,
    model          TEXT    NOT NULL,
    worker         TEXT    NOT NULL,
    dp_rank        INTEGER NOT NULL,
    role           TEXT    NOT NULL,
    hour           TEXT    NOT NULL,
    routed_seq     INTEGER NOT NULL,
    routed_us      INTEGER NOT NULL,
    policy         TEXT    NOT NULL,
    prompt_tokens  INTEGER NOT NULL,
    request_blocks INTEGER NOT NULL,
    overlap_blocks INTEGER NOT NULL,
    finished_seq   INTEGER,
    finished_us    INTEGER,
    status         TEXT,
    ttft_us        INTEGER,
    tokens_in      INTEGER,
    tokens_out     INTEGER,
    cached_tokens  INTEGER
);
CREATE INDEX requests_model_worker_hour ON requests (model, worker, hour);
